"""The Python side of benchmarks/bench_largest_model.cpp: one rank of PyTorch's FSDP2 training
the same BERT-style encoder (the modules of examples/encoder/bert.hpp, random initialisation,
mean pooling, a Linear head), each encoder layer a fully_shard unit and the root one too,
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torch.utils.checkpoint
(use_reentrant=False) around every layer, AdamW (fused) on the sharded fp32 parameters,
clipping at 1; its checkpoint through torch.distributed.checkpoint (each rank writes its own
shards and the metadata; a load at any world size reads the ranges it needs). The model is built
on the meta device and each rank allocates only its shards (FSDP2's recipe): construction never
holds the whole model.

    python fsdp_encoder.py RANK WORLD DIR python CHECKPOINT ZERO3 LAYERS STEPS BUDGET_MIB smoke|full MODE PATH

(the C++ ranks' arguments; CHECKPOINT 0 leaves the layers unchecked, ZERO3 is always 1; MODE
run: build, steps, save to PATH, load it, teardown; load: build, load PATH, teardown; steps:
build, steps, teardown). Each phase's peak RSS is measured on its own (VmHWM reset at its
start). Writes DIR/rankRANK.txt as the C++ ranks do: "ok params N base MIB rest MIB state BYTES
ms MS build MIB steps MIB ... losses L1 L2 ...", or "over PHASE RSS" when the RSS passed the
budget, then exits with status 3.
"""
import gc
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


def status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


class Watchdog:
    """Ends the process once its RSS passes the cap, writing "over PHASE RSS" first."""

    def __init__(self, path, cap):
        self.path, self.cap, self.phase = path, cap, "build"
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while True:
            rss = status_mib("VmRSS")
            if rss > self.cap:
                with open(self.path, "w") as f:
                    f.write(f"over {self.phase} {rss:.1f}\n")
                os._exit(3)
            time.sleep(0.005)


class Config:
    def __init__(self, smoke, layers):
        self.hidden, self.heads, self.intermediate = (256, 4, 1024) if smoke else (768, 12, 3072)
        self.vocab, self.positions = (1000, 64) if smoke else (30522, 512)
        self.tokens = 32 if smoke else 128
        self.layers, self.batch, self.classes, self.dropout = layers, 4, 8, 0.1


class Residual(torch.nn.Module):  # BertSelfOutput, BertOutput
    def __init__(self, width, c):
        super().__init__()
        self.dense = torch.nn.Linear(width, c.hidden)
        self.LayerNorm = torch.nn.LayerNorm(c.hidden, eps=1e-12)
        self.dropout = torch.nn.Dropout(c.dropout)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c.heads
        self.query = torch.nn.Linear(c.hidden, c.hidden)
        self.key = torch.nn.Linear(c.hidden, c.hidden)
        self.value = torch.nn.Linear(c.hidden, c.hidden)
        self.attention_output = Residual(c.hidden, c)
        self.intermediate = torch.nn.Linear(c.hidden, c.intermediate)
        self.output = Residual(c.intermediate, c)
        self.dropout = torch.nn.Dropout(c.dropout)

    def forward(self, x, keep):
        b, t, h = x.shape
        d = h // self.heads

        def split(y):
            return y.view(b, t, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5
        # As mixprec's masked_softmax: fp32 inside, the padded keys at the dtype's lowest value.
        scores = scores.float().masked_fill(~keep, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        context = torch.matmul(self.dropout(probs), v).transpose(1, 2).reshape(b, t, h)
        a = self.attention_output(context, x)
        return self.output(F.gelu(self.intermediate(a)), a)


class Classifier(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(c.vocab, c.hidden)
        self.position_embeddings = torch.nn.Embedding(c.positions, c.hidden)
        self.token_type_embeddings = torch.nn.Embedding(2, c.hidden)
        self.LayerNorm = torch.nn.LayerNorm(c.hidden, eps=1e-12)
        self.dropout = torch.nn.Dropout(c.dropout)
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.pooler = torch.nn.Linear(c.hidden, c.hidden)  # unused, as in bert.hpp's classifier
        self.head = torch.nn.Linear(c.hidden, c.classes)
        self.checkpointed = False

    def forward(self, ids, mask):
        positions = torch.arange(ids.size(1)).unsqueeze(0)
        x = (self.word_embeddings(ids) + self.token_type_embeddings(torch.zeros_like(ids))
             + self.position_embeddings(positions))
        x = self.dropout(self.LayerNorm(x))
        keep = mask.bool().view(mask.size(0), 1, 1, mask.size(1))
        for layer in self.layers:
            x = checkpoint(layer, x, keep, use_reentrant=False) if self.checkpointed else layer(x, keep)
        weights = mask.to(x.dtype).unsqueeze(-1)
        return self.head(self.dropout((x * weights).sum(1) / weights.sum(1).clamp_min(1)))


def local_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.untyped_storage().data_ptr() in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


class Phases:
    """Each phase's peak RSS (MiB): VmHWM reset when it starts, read when the next one starts."""

    def __init__(self, watchdog):
        self.watchdog, self.current, self.peaks = watchdog, None, []

    def start(self, name):
        self.finish()
        self.current, self.watchdog.phase = name, name
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM restarts from the RSS
            f.write("5")

    def finish(self):
        if self.current is not None:
            self.peaks.append((self.current, status_mib("VmHWM")))
        self.current = None


def checkpoint_state(model, optimizer):
    # FSDP2's sharded state dicts (DTensors): each rank saves and loads its own shards.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def main():
    rank, world, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    checkpointed = sys.argv[5] == "1"
    layers, steps, budget = int(sys.argv[7]), int(sys.argv[8]), float(sys.argv[9])
    smoke = sys.argv[10] == "smoke"
    mode, path = sys.argv[11], sys.argv[12]
    out_path = os.path.join(out_dir, f"rank{rank}.txt")
    torch.set_num_threads(1)
    watchdog = Watchdog(out_path, budget)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "pystore"),
                            rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    base = status_mib("VmRSS")
    phases = Phases(watchdog)
    phases.start("build")
    c = Config(smoke, layers)
    torch.manual_seed(1)
    with torch.device("meta"):
        model = Classifier(c)
    model.checkpointed = checkpointed
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    parameters = sum(p.numel() for p in model.parameters())  # the global shapes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    rest = status_mib("VmRSS")

    times, losses, state = [], [], 0
    if mode != "load":
        phases.start("steps")
        gen = torch.Generator().manual_seed(7 + rank)
        ids = torch.randint(1000 % c.vocab, c.vocab, (c.batch, c.tokens), generator=gen)
        mask = torch.ones(c.batch, c.tokens, dtype=torch.long)
        labels = torch.randint(0, c.classes, (c.batch,), generator=gen)
        torch.manual_seed(100 + rank)
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            loss = F.cross_entropy(model(ids, mask).float(), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append((time.perf_counter() - start) * 1000)
    state = local_bytes(list(model.parameters())
                        + [t for s in optimizer.state.values() for t in s.values()
                           if torch.is_tensor(t) and t.dim() > 0])
    if mode == "run":
        phases.start("save")
        dcp.save(checkpoint_state(model, optimizer), checkpoint_id=path)
    if mode != "steps":
        phases.start("load")
        loaded = checkpoint_state(model, optimizer)
        # The pooler (unused by the classifier, as in bert.hpp) never had a gradient, so AdamW
        # saved no state for it: a partial load, as mixprec's checkpoints hold none for it either.
        dcp.load(loaded, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"], options=StateDictOptions(strict=False))
        del loaded
    phases.start("teardown")
    del optimizer, model
    gc.collect()
    phases.finish()
    with open(out_path, "w") as f:
        f.write(f"ok params {parameters} base {base:.1f} rest {rest:.1f} state {state} "
                f"ms {times[-1] if times else 0:.1f} "
                + " ".join(f"{name} {peak:.1f}" for name, peak in phases.peaks)
                + " losses " + " ".join(f"{l:.9g}" for l in losses) + "\n")
    # No destroy_process_group(): tearing the Gloo group down can abort a rank (SIGABRT,
    # "terminate called without an active exception") while a peer still tears down.
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
