"""The Python side of benchmarks/bench_gpu.cpp: the same GPT-style block, weights and data
(drawn from the same seed by the CPU generator in the same order), trained by Python's recipes,
driven over a pipe.

    python bench_gpu.py DEVICE D HEADS SEQ BATCH WARMUP STEPS SEED THREADS

Prints "ready TORCH_VERSION WEIGHTS_CHECKSUM DATA_CHECKSUM", then answers each "run MODE" with
"ms MEDIAN_MS peak PEAK_MIB" (the median of the timed steps after warm-up; the peak of
torch.cuda.max_memory_allocated above what was allocated before the row, -1 on the CPU) or
"skip REASON". MODE: fp32, tf32 (torch.backends.cuda.matmul.allow_tf32), bf16 (torch.autocast),
fp16 (torch.autocast + GradScaler), fp8 (torchao's Float8Linear, dynamic tensorwise scaling, fp32
parameters under torch.autocast(bf16); emulate=True on the CPU). AdamW, fused where the device
has the kernel. torchao runs eagerly (torch.compile swapped for the identity, as tests/parity.py
does): the C++ side compiles nothing either.
"""
import copy
import statistics
import sys
import time

import torch

# Eager: torchao compiles its casts with torch.compile, which would spend minutes compiling.
torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        scale = 1.0 / q.size(-1) ** 0.5
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        weights = (torch.matmul(q, k.transpose(-2, -1)) * scale).masked_fill(future, float("-inf")).softmax(-1)
        h = x + self.proj(torch.matmul(weights, v).transpose(1, 2).reshape(b, s, -1))
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(h))))


class Net(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.block = Block(d, heads)

    def forward(self, x):
        return self.block(x)


def checksum(tensors):
    return sum(t.detach().double().sum().item() for t in tensors)


def main(device, d, heads, seq, batch, warmup, steps, seed, threads):
    d, heads, seq, batch, warmup, steps = map(int, (d, heads, seq, batch, warmup, steps))
    torch.set_num_threads(int(threads))
    cuda = device == "cuda"
    net = Net(d, heads)
    torch.manual_seed(int(seed))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape) * 0.02)
            else:
                p.copy_(torch.ones(p.shape) if "ln" in name and "weight" in name else torch.zeros(p.shape))
    torch.manual_seed(int(seed) + 1)
    x = torch.randn(batch, seq, d)
    target = torch.randn(batch, seq, d)
    print(f"ready {torch.__version__} {checksum(net.parameters())!r} {checksum([x, target])!r}", flush=True)
    x, target = x.to(device), target.to(device)

    def sync(model):
        next(model.parameters()).view(-1)[0].item()

    def run(mode):
        if mode == "tf32" and not cuda:
            return "skip TF32 is CUDA's"
        model = copy.deepcopy(net)
        if mode in ("fp8", "fp8_rowwise"):
            try:
                import dataclasses
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            except ImportError as e:
                return f"skip no torchao ({e})"
            recipe = "tensorwise" if mode == "fp8" else "rowwise"
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=not cuda)
            # Every dimension here is a multiple of 16, as torchao's fp8 matmuls need.
            convert_to_float8_training(model, config=config)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        model = model.to(device)
        try:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        except (RuntimeError, TypeError):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
                 "fp8_rowwise": torch.bfloat16}.get(mode)
        scaler = torch.amp.GradScaler(device) if mode == "fp16" else None
        times = []
        for k in range(warmup + steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), target)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            sync(model)
            if k >= warmup:
                times.append((time.perf_counter() - start) * 1000.0)
        peak = (torch.cuda.max_memory_allocated() - start_bytes) / 2**20 if cuda else -1
        torch.backends.cuda.matmul.allow_tf32 = False
        del model, optimizer
        return f"ms {statistics.median(times):.4f} peak {peak:.1f}"

    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        try:
            reply = run(words[1]) if words[0] == "run" and len(words) == 2 else f"error unknown command {line!r}"
        except Exception as e:  # a recipe this torch lacks (1.13), or out of memory: the row says so
            reply = "skip " + f"{type(e).__name__}: {e}".splitlines()[0][:120]
        if cuda:
            torch.cuda.empty_cache()
        print(reply, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
