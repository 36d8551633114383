"""The Python side of benchmarks/bench_encoder.cpp: one fine-tuning configuration of the same
pretrained encoder (transformers' BertModel, mean pooling, a Linear head, AdamW, clipping at 1),
in a process of its own so that its peak RSS is its own.

    python encoder_step.py MODE MODEL_DIR DATA STEPS THREADS [fused] [checkpoint] [memory]
                           [budget=MIB]

MODE: fp32, bf16 (torch.autocast), fp16 (autocast + GradScaler("cpu")), or bf16-fp32-softmax:
torch.autocast with the attention's softmax computed and returned in fp32, then cast to bf16 (as
mixprec's MixedO1 computes ops::masked_softmax, and as CUDA's autocast lists softmax; the CPU's
autocast leaves it in bf16). DATA: the C++ side's torch::pickle_save dict of ids, mask, labels.
checkpoint: transformers' activation_checkpointing_enable(), formerly
gradient_checkpointing_enable() (torch.utils.checkpoint with use_reentrant=False around every
layer). memory: the whole run under torch.profiler with
profile_memory=True, which reports every allocation and free of the CPU allocator: the peak of
live tensor bytes during the last step, and what was live when it began (the C++ side reads the
same reports, benchmarks/tensor_memory.hpp); the profiler slows the steps, so such a run is not
timed. budget=MIB: exit with status 3 as soon as the RSS exceeds MIB.

Prints "ms T2 T3 ... rss PEAK_RSS_MIB live PEAK_MIB START_MIB": the step times after the first
(which allocates the optimizer state), the peak RSS (VmHWM), and the live tensor bytes (-1
without memory).
"""
import os
import resource
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import BertModel
from torch._C._autograd import DeviceType
from transformers.models.bert import modeling_bert


def fp32_softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           **kwargs):
    """transformers' eager attention with the softmax in fp32, its result cast to the values'
    dtype."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class Classifier(torch.nn.Module):
    def __init__(self, model_dir, classes):
        super().__init__()
        self.bert = BertModel.from_pretrained(model_dir, attn_implementation="eager")
        self.head = torch.nn.Linear(self.bert.config.hidden_size, classes)

    def forward(self, ids, mask):
        hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp_min(1))


def watch_rss(budget_mib):
    """Exits with status 3 once the resident set exceeds the budget (a batch too large)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def poll():
        while True:
            with open("/proc/self/statm") as statm:
                resident = int(statm.read().split()[1]) * page / 2**20
            if resident > budget_mib:
                print("over budget", flush=True)
                os._exit(3)
            time.sleep(0.01)

    threading.Thread(target=poll, daemon=True).start()


def live_bytes(prof, step_name):
    """The peak of live tensor bytes during the step recorded as step_name, and what was live
    when it began, from the profiler's memory events (allocations and frees, in time order)."""
    events = prof.profiler.kineto_results.events()
    step = [e for e in events if e.name() == step_name][-1]
    start, end = step.start_ns(), step.start_ns() + step.duration_ns()
    memory = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU),
                    key=lambda e: e.start_ns())
    live, at_start, peak = 0, None, None
    for e in memory:
        if e.start_ns() >= start and at_start is None:
            at_start = peak = live
        live += e.nbytes()
        if at_start is not None and e.start_ns() <= end:
            peak = max(peak, live)
    return peak, at_start


def main(mode, model_dir, data_path, steps, threads, *flags):
    torch.set_num_threads(int(threads))
    for flag in flags:
        if flag.startswith("budget="):
            watch_rss(float(flag[len("budget="):]))
    memory = "memory" in flags
    profiler = None
    if memory:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          profile_memory=True)
        profiler.__enter__()
    data = torch.load(data_path, weights_only=False)
    model = Classifier(model_dir, 8).train()
    if "checkpoint" in flags:
        # transformers 5.23 names it activation_checkpointing_enable (gradient_checkpointing_enable
        # is its deprecated alias); both checkpoint every layer with use_reentrant=False.
        enable = getattr(model.bert, "activation_checkpointing_enable", None)
        (enable or model.bert.gradient_checkpointing_enable)()
    fused = "fused" in flags
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused,
                                  foreach=None if fused else False)
    if mode == "bf16-fp32-softmax":
        modeling_bert.eager_attention_forward = fp32_softmax_attention  # "eager" looks it up per call
    dtype = {"bf16": torch.bfloat16, "bf16-fp32-softmax": torch.bfloat16, "fp16": torch.float16}.get(mode)
    scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
    times = []
    for k in range(int(steps)):
        step = torch.profiler.record_function("measured_step") if memory and k == int(steps) - 1 else None
        if step is not None:
            step.__enter__()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(data["ids"], data["mask"])
        loss = torch.nn.functional.cross_entropy(logits.float(), data["labels"])
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        loss.item()
        times.append((time.perf_counter() - start) * 1000.0)
        if step is not None:
            step.__exit__(None, None, None)
    peak, at_start = -1, -1
    if memory:
        profiler.__exit__(None, None, None)
        peak, at_start = live_bytes(profiler, "measured_step")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    timed = times[1:] if len(times) > 1 else times
    print("ms " + " ".join(f"{t:.3f}" for t in timed) +
          f" rss {rss:.1f} live {peak / 2**20 if peak >= 0 else -1:.1f}"
          f" {at_start / 2**20 if at_start >= 0 else -1:.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
