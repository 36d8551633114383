"""PyTorch's own AMP recipe, step by step, for tests/test_parity.cpp to compare against.

    python parity.py MODE INPUT OUTPUT

MODE is fp32 (plain), bf16 (torch.autocast on the CPU) or fp16 (torch.autocast + the CPU
GradScaler); branch_fp32 and branch_bf16 train the two-headed model of `branch()` instead, whose
head b is used on even steps only, with AdamW (a parameter without a gradient is skipped);
inbackward_fp32 and inbackward_bf16 the same with PyTorch's optimizer-in-backward recipe (an
AdamW per parameter, stepped by a post-accumulate-grad hook);
ddp_fp32 and ddp_bf16 train with DistributedDataParallel on Gloo ranks (`ddp()`), and OUTPUT is
then a prefix: OUTPUT.rankR.txt for each rank R; zero_adamw does the same with DDP and
ZeroRedundancyOptimizer(AdamW), each step's line starting with the rank's loss; fsdp2_fp32 and
fsdp2_bf16 write the same lines for zero_adamw's model sharded by PyTorch's FSDP2 (`fsdp2()`).
INPUT is a torch::pickle_save dict from the C++ side: the initial weights (param.NAME), the data
(x, y) and the hyperparameters (steps, batch, lr, momentum, and for fp16 init_scale,
growth_interval). Mode schedule trains with learning-rate schedules (`schedule()`);
sr_adamw with torchao's stochastically rounding AdamW (`sr_adamw()`); grads writes what p.grad
holds after scaler.step(opt) (`grads()`).
OUTPUT gets one line per step: "loss scale skipped", the loss as
repr() of the fp32 value, the scale the step used, and 1 when the step was skipped.
"""
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing


def build_model():
    # The same architecture and parameter names as the C++ torch::nn::Sequential.
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


class Branchy(torch.nn.Module):
    # The C++ test's model: a trunk and two heads, the same parameter names.
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(16, 32)
        self.a = torch.nn.Linear(32, 4)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x, use_b):
        h = torch.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def branch(mode, data, output_path):
    """AdamW on the two-headed model; OUTPUT gets one line per step: every parameter's values,
    flattened in named_parameters() order, as repr() of each float."""
    model = Branchy()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    def adamw(params):
        return torch.optim.AdamW(params, lr=float(data["lr"]),
                                 weight_decay=float(data["weight_decay"]), foreach=False)
    in_backward = "inbackward" in mode
    if in_backward:
        # PyTorch's optimizer-in-backward recipe: an optimizer per parameter, stepped by a hook
        # as soon as that parameter's gradient is accumulated, its gradient freed there.
        optimizers = {p: adamw([p]) for p in model.parameters()}

        def step_now(p):
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_now)
    else:
        optimizer = adamw(model.parameters())
    with open(output_path, "w") as out:
        for step in range(steps):
            xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
            if not in_backward:
                optimizer.zero_grad(set_to_none=True)  # the default from torch 2.0 on, not in 1.13
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode.endswith("_bf16")):
                loss = torch.nn.functional.cross_entropy(model(xb, step % 2 == 0), yb)
            loss.float().backward()
            if not in_backward:
                optimizer.step()
            values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out.write(" ".join(repr(v) for v in values.tolist()) + "\n")


def sr_adamw(data, output_path):
    """torchao's _AdamW(bf16_stochastic_round=True) on the model in bf16, once per seed in
    data["seeds"] (the seed of torch's generator, whose bits its rounding draws); OUTPUT gets one
    line per step: the loss of each seed's run."""
    import torchao.optim
    # Eager: torchao compiles its step with torch.compile, which needs no graph here and would
    # spend a minute in the C++ compiler. The arithmetic is the same.
    torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
    x, y = data["x"], data["y"]
    steps, batch, rows = int(data["steps"]), int(data["batch"]), data["x"].shape[0]
    runs = []
    for seed in range(int(data["seeds"])):
        torch.manual_seed(seed)
        model = build_model()
        model.load_state_dict({k[len("param."):]: v for k, v in data.items()
                               if k.startswith("param.")})
        model = model.to(torch.bfloat16)
        optimizer = torchao.optim._AdamW(model.parameters(), lr=float(data["lr"]),
                                         weight_decay=float(data["weight_decay"]),
                                         bf16_stochastic_round=True)
        losses = []
        for step in range(steps):
            start = (step * batch) % rows
            xb, yb = x[start:start + batch], y[start:start + batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb.to(torch.bfloat16)).float(), yb)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs.append(losses)
    with open(output_path, "w") as out:
        for step in range(steps):
            out.write(" ".join(repr(run[step]) for run in runs) + "\n")


def write_line(out, tensors):
    values = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    out.write(" ".join(repr(v) for v in values.tolist()) + "\n")


def ddp_rank(rank, mode, data, prefix, store):
    """One rank of ddp(): DDP with its defaults (buffers broadcast from rank 0 before the first
    forward of each iteration, and before an evaluation forward after training), no_sync on all
    micro-batches but the last, SGD; one line per step (parameters then buffers) and one per
    evaluation output."""
    torch.set_num_threads(1)
    world = int(data["world"])
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    zero = mode == "zero_adamw"
    middle = torch.nn.ReLU() if zero else torch.nn.BatchNorm1d(8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), middle, torch.nn.Linear(8, 4))
    state = {k[len("param."):]: v for k, v in data.items() if k.startswith("param.")}
    state.update({k[len("buffer."):]: v for k, v in data.items() if k.startswith("buffer.")})
    model.load_state_dict(state)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=float(data["lr"]),
                                            weight_decay=float(data["weight_decay"]), foreach=False)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=float(data["lr"]),
                                    momentum=float(data["momentum"]), foreach=False)
    micro = int(data["micro_batches"])
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "ddp_bf16")
    with open(f"{prefix}.rank{rank}.txt", "w") as out:
        for step in range(int(data["steps"])):
            optimizer.zero_grad(set_to_none=True)
            losses = 0.0
            for j in range(micro):
                x = data[f"x.{rank}.{step}.{j}"]
                sync = contextlib.nullcontext() if j == micro - 1 else ddp.no_sync()
                with sync:
                    with autocast():
                        loss = ddp(x).float().pow(2).mean()
                    (loss / micro).backward()
                losses += loss.item() / micro
            optimizer.step()
            first = [torch.tensor([losses], dtype=torch.float64)] if zero else []
            write_line(out, first + list(model.parameters()) + list(model.buffers()))
        ddp.eval()
        with torch.no_grad():
            for _ in range(2):
                with autocast():
                    write_line(out, [ddp(data["x.eval"])])
    # Leave without tearing down: torch 1.13 can deadlock destroying the Gloo group under DDP
    # (its Reducer's destructor joins a Gloo thread that waits for the GIL held here).
    os._exit(0)


def ddp(mode, data, prefix):
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(ddp_rank, args=(mode, data, prefix, os.path.join(tmp, "store")),
                                    nprocs=int(data["world"]), join=True)


def fsdp2_rank(rank, mode, data, prefix, store):
    """One rank of fsdp2(): zero_adamw's model (Linear, ReLU, Linear) under PyTorch's FSDP2, each
    Linear a unit and the root over them, AdamW on the sharded fp32 parameters (FSDP2's masters);
    fsdp2_bf16 gathers them as bf16 and reduce-scatters the gradients in fp32. One line per step
    (the rank's loss, then every parameter's full value) and one per evaluation output."""
    torch.set_num_threads(1)
    world = int(data["world"])
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    kwargs = {"mesh": init_device_mesh("cpu", (world,))}
    if mode == "fsdp2_bf16":
        # cast_forward_inputs: the root casts x to bf16, as the C++ side's cast_input does (an
        # fp32 x into the bf16 weights is refused: "mat1 and mat2 must have the same dtype").
        # output_dtype None: the output stays bf16 and the loss upcasts it (out.float()), as
        # zero_adamw and the C++ side do; float32 there gives the same lines.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32, output_dtype=None,
                                                   cast_forward_inputs=True)
    for unit in (model[0], model[2]):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(data["lr"]),
                                  weight_decay=float(data["weight_decay"]), foreach=False)
    micro = int(data["micro_batches"])
    with open(f"{prefix}.rank{rank}.txt", "w") as out:
        for step in range(int(data["steps"])):
            optimizer.zero_grad(set_to_none=True)
            losses = 0.0
            for j in range(micro):
                # FSDP2 reduce-scatters after every micro-batch (FSDP2's default, kept) and adds
                # the fp32 shard into the gradient: sum over j of avg over ranks of (g / micro),
                # where DDP sums a rank's micro-batches first and then averages over ranks: a
                # different order, the same value up to rounding. Gloo's AVG sums the ranks'
                # values (the shard's owner last, as seen for 2 and 3 ranks), then divides.
                loss = model(data[f"x.{rank}.{step}.{j}"]).float().pow(2).mean()
                (loss / micro).backward()
                losses += loss.item() / micro
            optimizer.step()
            # full_tensor() is a collective: every rank gathers every parameter, in order.
            full = [p.full_tensor() for p in model.parameters()]
            write_line(out, [torch.tensor([losses], dtype=torch.float64)] + full)
        model.eval()
        with torch.no_grad():
            for _ in range(2):
                write_line(out, [model(data["x.eval"])])
    # Leave without tearing down, as ddp_rank does: destroying the Gloo group can end in
    # "terminate called without an active exception" (SIGABRT) while a peer is still tearing
    # down, seen under load. The barrier first, so that no peer is inside a collective.
    dist.barrier()
    os._exit(0)


def fsdp2(mode, data, prefix):
    if mode not in ("fsdp2_fp32", "fsdp2_bf16"):
        sys.exit(f"parity.py: unknown mode {mode}; the FSDP2 modes are fsdp2_fp32 and fsdp2_bf16")
    # By version, not by import: importing torch.distributed.fsdp fails outright on Debian's 1.13
    # under Python 3.11.
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 6):
        sys.exit(f"parity.py {mode}: needs torch.distributed.fsdp.fully_shard (torch 2.6 or "
                 f"newer); this Python has torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(fsdp2_rank,
                                    args=(mode, data, prefix, os.path.join(tmp, "store")),
                                    nprocs=int(data["world"]), join=True)


def schedule(data, output_path):
    """The learning-rate schedules of Python's AMP loop, for the Trainer's lr_scheduler and
    lr_lambda: SGD over two param groups, two micro-batches per optimizer step (each loss / 2),
    StepLR(step_size 3, gamma 0.5) or LambdaLR(warm-up, then halving every 5 steps) stepped after
    every optimizer step, taken or skipped. Configurations (data["configs"]): "KIND_PREC" with
    PREC fp16 (torch.autocast + GradScaler("cpu"): overflows skip) or fp32 (a step skipped where
    a gradient is not finite); the micro-batches in data["poison"] have their loss multiplied by
    inf. OUTPUT: per optimizer step "CONFIG lr0 lr1 scale skipped loss0 loss1", the lrs the
    step used (before scheduler.step())."""
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    poison = set(int(i) for i in data["poison"].tolist())
    weights = {k[len("param."):]: v for k, v in data.items() if k.startswith("param.")}
    with open(output_path, "w") as out:
        for config in data["configs"].split(","):
            kind, prec = config.split("_")
            model = build_model()
            model.load_state_dict(weights)
            first = list(model[0].parameters())
            rest = [p for p in model.parameters() if all(p is not q for q in first)]
            optimizer = torch.optim.SGD([{"params": first, "lr": float(data["lr0"])},
                                         {"params": rest, "lr": float(data["lr1"])}],
                                        lr=float(data["lr0"]), momentum=0.9, foreach=False)
            if kind == "step":
                scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            else:
                scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer, lambda k: (k + 1) / 4 if k < 4 else 0.5 ** ((k - 4) // 5))
            scaler = None
            if prec == "fp16":
                scaler = torch.amp.GradScaler("cpu", init_scale=float(data["init_scale"]),
                                              growth_interval=int(data["growth_interval"]))
            for step in range(steps):
                lrs = [group["lr"] for group in optimizer.param_groups]
                losses = []
                for micro in range(2):
                    i = 2 * step + micro
                    start = (i * batch) % x.shape[0]
                    xb, yb = x[start:start + batch], y[start:start + batch]
                    # torch 1.13 refuses an fp16 CPU autocast even disabled: none for fp32.
                    autocast = (torch.autocast("cpu", dtype=torch.float16) if scaler
                                else contextlib.nullcontext())
                    with autocast:
                        loss = torch.nn.functional.cross_entropy(model(xb), yb)
                    loss = loss.float()
                    if i in poison:
                        loss = loss * float("inf")
                    losses.append(loss.item())
                    (scaler.scale(loss / 2) if scaler else loss / 2).backward()
                if scaler is None:
                    scale = 1.0
                    skipped = not all(torch.isfinite(p.grad).all() for p in model.parameters())
                    if not skipped:
                        optimizer.step()
                else:
                    scale = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    skipped = scaler.get_scale() < scale
                scheduler.step()
                optimizer.zero_grad()
                out.write(f"{config} {lrs[0]!r} {lrs[1]!r} {scale!r} {int(skipped)} "
                          f"{losses[0]!r} {losses[1]!r}\n")


def grads(data, output_path):
    """What `p.grad` holds after `scaler.step(opt)`, for the Trainer's on_step gradients(): the
    model of build_model(), SGD, two micro-batches per optimizer step (each loss / 2), clipped to
    data["clip"] after scaler.unscale_(opt); data["prec"] fp16 (torch.autocast +
    GradScaler("cpu")) or fp32. OUTPUT: per optimizer step "scale" then every parameter's p.grad
    after scaler.step, flattened in named_parameters() order."""
    model = build_model()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    x, y = data["x"], data["y"]
    steps, batch, rows = int(data["steps"]), int(data["batch"]), data["x"].shape[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=float(data["lr"]),
                                momentum=float(data["momentum"]), foreach=False)
    # fp32: no scaler (torch 1.13 has no CPU GradScaler, and refuses an fp16 CPU autocast even
    # disabled).
    scaler = None
    if data["prec"] == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=float(data["init_scale"]),
                                      growth_interval=int(data["growth_interval"]))
    with open(output_path, "w") as out:
        for step in range(steps):
            optimizer.zero_grad()
            for micro in range(2):
                start = ((2 * step + micro) * batch) % rows
                xb, yb = x[start:start + batch], y[start:start + batch]
                autocast = (torch.autocast("cpu", dtype=torch.float16) if scaler
                            else contextlib.nullcontext())
                with autocast:
                    loss = torch.nn.functional.cross_entropy(model(xb), yb)
                (scaler.scale(loss.float() / 2) if scaler else loss.float() / 2).backward()
            scale = scaler.get_scale() if scaler else 1.0
            if scaler:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(data["clip"]))
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            grads = torch.cat([p.grad.detach().double().reshape(-1) for p in model.parameters()])
            out.write(" ".join([repr(scale)] + [repr(v) for v in grads.tolist()]) + "\n")


def main(mode, input_path, output_path):
    torch.set_num_threads(1)
    data = torch.load(input_path, weights_only=False)
    if mode == "schedule":
        return schedule(data, output_path)
    if mode == "grads":
        return grads(data, output_path)
    if mode == "sr_adamw":
        return sr_adamw(data, output_path)
    if mode.startswith("branch") or mode.startswith("inbackward"):
        return branch(mode, data, output_path)
    if mode.startswith("ddp") or mode.startswith("zero"):
        return ddp(mode, data, output_path)
    if mode.startswith("fsdp2"):
        return fsdp2(mode, data, output_path)
    model = build_model()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    # foreach=False: the per-tensor loop of LibTorch's torch::optim::SGD.
    optimizer = torch.optim.SGD(model.parameters(), lr=float(data["lr"]),
                                momentum=float(data["momentum"]), foreach=False)
    scaler = None
    if mode == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=float(data["init_scale"]),
                                      growth_interval=int(data["growth_interval"]))
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    rows = x.shape[0]
    with open(output_path, "w") as out:
        for step in range(steps):
            start = (step * batch) % rows
            xb, yb = x[start:start + batch], y[start:start + batch]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss = loss.float()
            if scaler is None:
                loss.backward()
                skipped = not all(torch.isfinite(p.grad).all() for p in model.parameters())
                if not skipped:
                    optimizer.step()
                scale = 1.0
            else:
                scale = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                skipped = scaler.get_scale() < scale  # PyTorch backs off exactly on a skip
            out.write(f"{loss.item()!r} {scale!r} {int(skipped)}\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
