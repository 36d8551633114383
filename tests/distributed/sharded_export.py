"""The streamed fp32 export of a sharded run (tests/distributed/sharded_checkpoint_cases.hpp).

    python sharded_export.py MODEL.safetensors REFERENCE.pkl

Builds the test's UnitNet in Python (Linear layers in, h1, h2, frozen, out), loads the streamed
file into it with load_state_dict(strict=True), and compares every tensor with the gathered
export (Trainer::save_fp32, WeightsFormat::pickle), bit for bit. Exits 1 on any difference.
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
    dtypes = {"F32": torch.float32, "I64": torch.int64, "BF16": torch.bfloat16}
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
    if differ or set(reference) != set(streamed):
        print(f"sharded_export.py: differ: {differ}; names {sorted(set(reference) ^ set(streamed))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
