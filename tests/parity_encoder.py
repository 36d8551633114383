"""Hugging Face's side of the encoder parity tests (tests/test_encoder.cpp, label python).

    python parity_encoder.py jobs MODEL_DIR JOBS
        every job of JOBS, one "MODE INPUT OUTPUT" a line (the modes below), in this one
        process: the test runs them all at once, so that torch and transformers are imported
        once, not once per case (seconds each)
    python parity_encoder.py tokens MODEL_DIR TEXTS OUTPUT
        the `tokenizers` ids of each line of TEXTS (UTF-8), [CLS] and [SEP] included, one line
        of ids per text
    python parity_encoder.py hidden MODEL_DIR INPUT OUTPUT
        transformers' BertModel last_hidden_state (fp32, eval mode) for INPUT's ids and mask,
        as a torch.save'd tensor
    python parity_encoder.py finetune_fp32|finetune_bf16|finetune_fp16 MODEL_DIR INPUT OUTPUT
        fine-tunes BertModel + mean pooling + a Linear head (INPUT's initial weights) with AdamW
        on INPUT's batches, dropout off; fp32, torch.autocast(bfloat16), or autocast(float16) +
        GradScaler("cpu"); clipping at INPUT's max_grad_norm after unscale_; INPUT's steps (or
        its "steps.MODE" where it has one) steps. One line per step:
        the loss (repr of the fp32 value), the scale, 1 if the step was skipped. Each mode
        fine-tunes a model of its own, loaded afresh.

INPUT is a torch::pickle_save dict from the C++ side. No network: HF_HUB_OFFLINE=1.
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def tokens(model_dir, texts_path, output):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    with open(texts_path, encoding="utf-8") as f:
        texts = f.read().split("\n")[:-1]
    with open(output, "w") as out:
        for encoding in tokenizer.encode_batch(texts):
            out.write(" ".join(str(i) for i in encoding.ids) + "\n")


def bert(model_dir, dropout):
    from transformers import BertModel

    kwargs = {} if dropout else {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return BertModel.from_pretrained(model_dir, attn_implementation="eager", **kwargs)


def hidden(model_dir, data, output):
    model = bert(model_dir, dropout=False).eval()
    with torch.no_grad():
        out = model(input_ids=data["ids"], attention_mask=data["mask"]).last_hidden_state
    torch.save(out, output)


class Classifier(torch.nn.Module):
    def __init__(self, model_dir, classes):
        super().__init__()
        self.bert = bert(model_dir, dropout=False)
        self.head = torch.nn.Linear(self.bert.config.hidden_size, classes)

    def forward(self, ids, mask):
        hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)
        return self.head(pooled)


def finetune(mode, model_dir, data, output):
    model = Classifier(model_dir, int(data["classes"]))
    with torch.no_grad():
        model.head.weight.copy_(data["head.weight"])
        model.head.bias.copy_(data["head.bias"])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(data["lr"]),
                                  weight_decay=float(data["weight_decay"]), foreach=False)
    dtype = {"finetune_bf16": torch.bfloat16, "finetune_fp16": torch.float16}.get(mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=float(data["init_scale"])) if mode == "finetune_fp16" else None
    clip = float(data["max_grad_norm"])
    with open(output, "w") as out:
        for step in range(int(data.get(f"steps.{mode}", data["steps"]))):
            ids, mask, labels = data[f"ids.{step}"], data[f"mask.{step}"], data[f"labels.{step}"]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = model(ids, mask)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            skipped = 0
            scale = 1.0
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
            else:
                scale = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(optimizer)
                scaler.update()
                skipped = int(scaler.get_scale() < scale)
            out.write(f"{loss.item()!r} {scale!r} {skipped}\n")


def run(mode, model_dir, input_path, output):
    if mode == "tokens":
        return tokens(model_dir, input_path, output)
    data = torch.load(input_path, weights_only=False)
    if mode == "hidden":
        return hidden(model_dir, data, output)
    if mode in ("finetune_fp32", "finetune_bf16", "finetune_fp16"):
        return finetune(mode, model_dir, data, output)
    raise SystemExit(f"parity_encoder.py: unknown mode {mode!r}")


def main(mode, *args):
    torch.set_num_threads(1)
    if mode != "jobs":
        return run(mode, *args)
    model_dir, jobs = args
    with open(jobs) as f:
        for line in f:
            job_mode, input_path, output = line.split()
            run(job_mode, model_dir, input_path, output)


if __name__ == "__main__":
    main(*sys.argv[1:])
