"""Python's side of tests/io/test_save_safetensors.cpp: what safetensors.torch makes of the files
mixprec writes, and files for mixprec to write again.

    python safetensors_roundtrip.py DIR

reads DIR/mixprec.safetensors with load_file and writes what it read with save_file (metadata
{"format": "pt"}) to DIR/python_again.safetensors, whose bytes the C++ side compares with its
own file: equal bytes mean that Python read every tensor bit for bit, and that mixprec lays the
file out as Python does. Then writes DIR/python.safetensors: a tensor of random bytes in every
dtype this torch and safetensors share (bool 0/1), for mixprec to read and write again.
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

CODES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
         "bool", "complex64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
         "float8_e5m2fnuz", "uint16", "uint32", "uint64", "float8_e8m0fnu", "float4_e2m1fn_x2"]


def main(directory):
    tensors = load_file(os.path.join(directory, "mixprec.safetensors"))
    save_file(tensors, os.path.join(directory, "python_again.safetensors"),
              metadata={"format": "pt"})
    generator = torch.Generator().manual_seed(3)
    mine = {}
    for name in CODES:
        if not hasattr(torch, name):
            continue
        dtype = getattr(torch, name)
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (3, 5 * size), dtype=torch.uint8, generator=generator)
        if dtype == torch.bool:
            raw = raw % 2
        mine["p_" + name] = raw.view(dtype)
    mine["p_scalar"] = torch.tensor(1.5, dtype=torch.float64)
    mine["p_empty"] = torch.empty(0, 4)
    save_file(mine, os.path.join(directory, "python.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1])
