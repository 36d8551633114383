"""The Python side of benchmarks/bench_encoder.cpp: one fine-tuning configuration of the same
pretrained encoder (transformers' BertModel, mean pooling, a Linear head, AdamW), in a process
of its own so that its peak RSS is its own.

    python encoder_step.py MODE MODEL_DIR DATA STEPS THREADS [fused]

MODE: fp32, bf16 (torch.autocast), fp16 (autocast + GradScaler("cpu")), or bf16-fp32-softmax:
torch.autocast with the attention's softmax computed and returned in fp32, then cast to bf16 (as
mixprec's MixedO1 computes ops::masked_softmax, and as CUDA's autocast lists softmax; the CPU's
autocast leaves it in bf16). DATA: the C++ side's
torch::pickle_save dict of ids, mask, labels. Prints "<median step ms> <peak RSS MiB>": the
median of the steps after the first (which allocates the optimizer state).
"""
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import BertModel
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


def main(mode, model_dir, data_path, steps, threads, *flags):
    torch.set_num_threads(int(threads))
    data = torch.load(data_path, weights_only=False)
    model = Classifier(model_dir, 8).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused="fused" in flags, foreach=False if "fused" not in flags else None)
    if mode == "bf16-fp32-softmax":
        modeling_bert.eager_attention_forward = fp32_softmax_attention  # "eager" looks it up per call
    dtype = {"bf16": torch.bfloat16, "bf16-fp32-softmax": torch.bfloat16, "fp16": torch.float16}.get(mode)
    scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
    times = []
    for _ in range(int(steps)):
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"{statistics.median(times[1:]) if len(times) > 1 else times[0]:.3f} {peak:.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
