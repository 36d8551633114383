"""Hugging Face's side of the encoder parity tests (tests/test_parity.cpp, label python).

    python parity_encoder.py tokens MODEL_DIR TEXTS OUTPUT
        the `tokenizers` ids of each line of TEXTS (UTF-8), [CLS] and [SEP] included, one line
        of ids per text
    python parity_encoder.py hidden MODEL_DIR INPUT OUTPUT
        transformers' BertModel last_hidden_state (fp32, eval mode) for INPUT's ids and mask,
        as a torch.save'd tensor
    python parity_encoder.py finetune_fp32|finetune_bf16|finetune_fp16 MODEL_DIR INPUT OUTPUT
        fine-tunes BertModel + mean pooling + a Linear head (INPUT's initial weights) with AdamW
        on INPUT's batches, dropout off; fp32, torch.autocast(bfloat16), or autocast(float16) +
        GradScaler("cpu"); clipping at INPUT's max_grad_norm after unscale_. One line per step:
        the loss (repr of the fp32 value), the scale, 1 if the step was skipped.

    python parity_encoder.py safetensors DIR
        writes files with safetensors.torch.save_file into DIR: empty tensors beside non-empty
        ones in several orders (the writer sorts by dtype, then name, so an empty tensor shares
        its offset with the next), every dtype the C++ reader knows, 0-d tensors, metadata; and
        DIR/manifest.json: each file's tensors' dtype and shape. Tensor values: element i of a
        tensor is (3 i + 1) mod 11, converted to its dtype.

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
        for step in range(int(data["steps"])):
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


def safetensors_files(directory):
    import json
    from safetensors.torch import save_file

    dtypes = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}

    def tensor(shape, dtype=torch.float32):
        n = 1
        for size in shape:
            n *= size
        return ((torch.arange(n) * 3 + 1) % 11).to(dtype).reshape(shape)

    files = {
        "empty_first.safetensors": ({"a": tensor([0]), "b": tensor([4])}, None),
        "empty_last.safetensors": ({"a": tensor([4]), "b": tensor([0])}, None),
        "empty_between_dtypes.safetensors": (
            {"z": tensor([0, 3]), "b": tensor([4]), "c": tensor([2, 0], torch.int8),
             "d": tensor([3], torch.float16)}, {"format": "pt", "note": "empty tensors"}),
        "empties_only.safetensors": ({"x": tensor([0]), "y": tensor([0, 5]), "z": tensor([3, 0, 2])}, None),
        "scalars.safetensors": ({"s": tensor([]), "e": tensor([0]), "t": tensor([], torch.int64)}, None),
        "every_dtype.safetensors": (
            {f"{name}_{kind}": tensor(shape, dtype) for dtype, name in dtypes.items()
             for kind, shape in (("empty", [0]), ("full", [3, 2]), ("wide_empty", [2, 0, 2]))},
            {"format": "pt"}),
    }
    manifest = {}
    for file, (tensors, metadata) in files.items():
        save_file(tensors, os.path.join(directory, file), metadata=metadata)
        manifest[file] = {name: {"dtype": dtypes[t.dtype], "shape": list(t.shape)}
                          for name, t in tensors.items()}
    with open(os.path.join(directory, "manifest.json"), "w") as out:
        json.dump(manifest, out)


def main(mode, *args):
    torch.set_num_threads(1)
    if mode == "safetensors":
        return safetensors_files(*args)
    model_dir, input_path, output = args
    if mode == "tokens":
        return tokens(model_dir, input_path, output)
    data = torch.load(input_path, weights_only=False)
    if mode == "hidden":
        return hidden(model_dir, data, output)
    return finetune(mode, model_dir, data, output)


if __name__ == "__main__":
    main(*sys.argv[1:])
