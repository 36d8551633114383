"""The streamed fp32 export of a sharded run (tests/distributed/sharded_checkpoint_cases.hpp).

    python sharded_export.py MODEL.safetensors REFERENCE.pkl CHECKPOINT_DIR

Builds the test's UnitNet in Python (Linear layers in, h1, h2, frozen, out), loads the streamed
file into it with load_state_dict(strict=True), and compares every tensor with the gathered
export (Trainer::save_fp32, WeightsFormat::pickle), bit for bit; then reassembles each fp32
master of the sharded checkpoint from its index (docs/distributed.md's recipe) and compares it
with the same export. Exits 1 on any difference.
Debian's python3 (torch 1.13) has no safetensors package: there the file is read by the format's
own rules (8-byte header length, JSON header, raw little-endian data).
"""
import json
import struct
import sys

import torch
from torch import nn


def read_safetensors(path):
    try:
        from safetensors.torch import load_file
    except ImportError:
        load_file = None
    if load_file is not None:
        return load_file(path), "safetensors.torch.load_file"
    with open(path, "rb") as f:
        data = f.read()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    start = 8 + length
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8}
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = dtypes[entry["dtype"]]
        raw = bytearray(data[start + begin:start + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"])
    return tensors, "the format's rules (no safetensors package)"


def checkpoint_tensor(directory, name):
    """A tensor of a sharded checkpoint: its pieces, from the shards that hold them, in order."""
    with open(f"{directory}/index.json") as f:
        index = json.load(f)
    names = {f["rank"]: f["name"] for f in index["files"] if "rank" in f}
    t = index["tensors"][name]
    pieces = [read_safetensors(f"{directory}/{names[rank]}")[0][name] for rank, start, count in t["pieces"]]
    return torch.cat(pieces).reshape(t["shape"])


def unit_net():
    net = nn.Module()
    for name, (n_in, n_out) in [("in", (8, 16)), ("h1", (16, 16)), ("h2", (16, 16)),
                                ("frozen", (16, 16)), ("out", (16, 4))]:
        net.add_module(name, nn.Linear(n_in, n_out))
    return net


def main():
    streamed, how = read_safetensors(sys.argv[1])
    reference = dict(torch.load(sys.argv[2]))
    net = unit_net()
    net.load_state_dict(streamed, strict=True)
    worst = 0.0
    differ = []
    for name, value in net.state_dict().items():
        ref = reference[name]
        if value.dtype != ref.dtype or value.shape != ref.shape or not torch.equal(value, ref):
            differ.append(name)
        worst = max(worst, (value.double() - ref.double()).abs().max().item() if value.numel() else 0.0)
    print(f"sharded_export.py: {len(streamed)} tensors read by {how}, "
          f"load_state_dict(strict=True) took them; largest difference to the gathered export: {worst}")
    masters_differ = [name for name in reference
                      if not torch.equal(checkpoint_tensor(sys.argv[3], "master." + name), reference[name])]
    print(f"sharded_export.py: the checkpoint's {len(reference)} masters reassembled from its index: "
          f"{len(reference) - len(masters_differ)} equal to the gathered export")
    if differ or masters_differ or set(reference) != set(streamed):
        print(f"sharded_export.py: differ: {differ}, masters {masters_differ}; "
              f"names {sorted(set(reference) ^ set(streamed))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
