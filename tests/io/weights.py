"""Python's side of the weight-loading tests (tests/io/): files written by the torch of this
Python (the wheel's 2.x, or Debian's 1.13 for the system build) and by `safetensors`, where it
is installed, for the C++ readers to read back value for value.

    python weights.py files DIR
        torch.save files: every dtype this torch has (values: element i of a tensor is
        (3 i + 1) mod 11 in its dtype), views of one storage (a column, a transpose, an offset
        slice, an expanded tensor, one tensor under two names), a module's state_dict() (an
        OrderedDict with _metadata), state_dict(keep_vars=True) (Parameters), pickle protocol 4,
        a checkpoint dict, (name, tensor) pairs, 300 records, no CRCs (torch 2.x's option), zip64
        records and end record, a checkpoint dict with ints beyond 64 bits (torch.initial_seed() after
        manual_seed(2**64 - 1), 2**64, -2**70, 2**63: torch.load(weights_only=True) reads
        them); and files mixprec refuses, with why: the legacy format, a pickled module, a
        TorchScript archive, a lone tensor, a re-compressed archive. safetensors files: empty
        tensors beside non-empty ones in several orders, every dtype, 0-d tensors, metadata, an
        empty tensor whose other sizes are 2**62; and under "safetensors_shapes", what Python's
        safetensors.torch.load does with headers whose sizes overflow beside a 0 ("read" or the
        exception). DIR/manifest.json: for each file, each tensor's dtype (torch's name), shape, stride,
        storage offset and values (as float64; complex as (real, imag) pairs), or the refusal.

    python weights.py trained DIR
        trains a small model (an embedding, a Linear, BatchNorm, LayerNorm, and an output layer
        tied to the embedding) for a few steps in fp32, then writes its state_dict() (trained.pt),
        safetensors' save_model of it (trained.safetensors: one name of the tied pair), its
        eval-mode outputs on a batch (outputs.pt: {"ids", "logits"}), and what PyTorch's
        load_state_dict(strict=False) reports for a state dict with a key dropped and one added
        (DIR/manifest.json); and state dicts without norm.num_batches_tracked (a plain dict, an
        OrderedDict whose _metadata says BatchNorm version 2 or 1, safetensors), with what
        PyTorch's load_state_dict does with each (manifest "batchnorm"). One thread, so that C++
        computes the same bits.
"""
import collections
import json
import os
import struct
import sys
import zipfile

import torch

try:
    from safetensors.torch import load_model, save_file, save_model
except ImportError:  # Debian's python3 (torch 1.13) has no safetensors
    load_model = save_file = save_model = None

SAFETENSORS = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
               torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        SAFETENSORS[getattr(torch, _name)] = _code


def dtypes():
    names = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
             "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
             "uint16", "uint32", "uint64"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def tensor(shape, dtype=torch.float32):
    n = 1
    for size in shape:
        n *= size
    return ((torch.arange(n) * 3 + 1) % 11).to(torch.float32).to(dtype).reshape(shape)


def describe(t):
    values = torch.view_as_real(t) if t.is_complex() else t
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "stride": list(t.stride()), "offset": t.storage_offset(),
            "values": values.to(torch.float64).reshape(-1).tolist()}


def rezip(source, target, compression=zipfile.ZIP_STORED, force_zip64=False):
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", compression) as new:
        for info in old.infolist():
            with new.open(info.filename, "w", force_zip64=force_zip64) as out:
                out.write(old.read(info.filename))


def with_zip64_end(source, target):
    """The archive with a zip64 end record and locator before its end record, whose fields
    then say 0xFFFF / 0xFFFFFFFF (what a writer does past 65535 records or 4 GiB)."""
    data = open(source, "rb").read()
    end = data.rindex(b"PK\x05\x06")
    entries, size, offset = struct.unpack("<HII", data[end + 10:end + 20])
    end = offset + size  # without the zip64 records torch 2.x writes anyway
    record = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries, size, offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, end, 1)
    tail = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    open(target, "wb").write(data[:end] + record + locator + tail)
    assert zipfile.ZipFile(target).testzip() is None


def safetensors_shapes():
    """What Python's safetensors (and torch under it) does with an F32 tensor of no bytes whose
    sizes overflow 64 bits beside a 0: safetensors multiplies the sizes in order (a product
    that passes 2**64 before the 0 is an error), torch computes the contiguous strides (a 0
    counts as 1: past 2**63 - 1 is an error)."""
    from safetensors.torch import load
    shapes = [[2**62, 2**62, 0], [0, 2**62, 2**62], [2**62, 0, 2**62], [2**31, 2**31, 4, 0],
              [0, 2**62, 4], [0, 2**63 - 1, 2], [2**63 - 1, 0], [0, 2**63 - 1], [3, 0, 2**61, 4],
              [2**63 - 1, 2, 0], [2**62, 3, 0]]
    verdicts = []
    for shape in shapes:
        header = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
        try:
            load(struct.pack("<Q", len(header)) + header)
            verdict = "read"
        except Exception as e:  # safetensors' SafetensorError, torch's RuntimeError
            verdict = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        verdicts.append({"shape": shape, "python": verdict})
    return verdicts


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.norm = torch.nn.BatchNorm1d(4)


def files(directory):
    manifest = {}

    def save(name, obj, expect=None, **kwargs):
        path = os.path.join(directory, name)
        torch.save(obj, path, **kwargs)
        if expect is not None:
            manifest[name] = {k: describe(v) for k, v in expect.items()}
        return path

    every = {}
    for dtype in dtypes():
        name = str(dtype).replace("torch.", "")
        for kind, shape in (("full", [3, 2]), ("empty", [0]), ("wide_empty", [2, 0, 2]), ("scalar", [])):
            every[f"{name}_{kind}"] = tensor(shape, dtype)
    save("dtypes.pt", every, every)

    base = tensor([4, 6])
    views = {"column": base[:, 1], "transposed": base.t(), "slice": base.view(-1)[5:17],
             "expanded": tensor([1, 3]).expand(4, 3), "whole": base, "tied": base}
    save("views.pt", views, views)

    torch.manual_seed(0)
    module = Small()
    module.norm(module.fc(torch.randn(8, 3)))  # running statistics, num_batches_tracked = 1
    state = module.state_dict()
    save("module.pt", state, state)
    save("keep_vars.pt", module.state_dict(keep_vars=True), state)
    save("protocol4.pt", state, state, pickle_protocol=4)
    save("checkpoint.pt", {"model": state, "epoch": 3, "lr": 0.5, "name": "run",
                           "optimizer": torch.optim.Adam(module.parameters()).state_dict()})
    manifest["checkpoint.pt"] = {"key": "model", **{k: describe(v) for k, v in state.items()}}
    save("pairs.pt", [(k, v) for k, v in state.items()], state)
    many = {f"t{i}": tensor([i % 5, 2]) for i in range(300)}  # 300 records, 60 of them empty
    save("many.pt", many, many)
    torch.manual_seed(2**64 - 1)  # the largest seed; torch.seed() gives one >= 2**63 half the time
    save("big_ints.pt", {"seed": torch.initial_seed(), "model": state, "big": 2**64,
                         "negative": -2**70, "edge": 2**63, "just_below": 2**63 - 1,
                         "nested": {2**65: [2**100, -2**63 - 1], "epoch": 3}})
    manifest["big_ints.pt"] = {"key": "model", **{k: describe(v) for k, v in state.items()}}
    torch.manual_seed(0)
    rezip(os.path.join(directory, "module.pt"), os.path.join(directory, "zip64_records.pt"),
          force_zip64=True)
    manifest["zip64_records.pt"] = manifest["module.pt"]
    with_zip64_end(os.path.join(directory, "module.pt"), os.path.join(directory, "zip64_end.pt"))
    manifest["zip64_end.pt"] = manifest["module.pt"]
    try:
        from torch.utils.serialization import config
        config.save.compute_crc32 = False
        save("no_crc.pt", state, state)
        config.save.compute_crc32 = True
    except ImportError:
        pass  # torch 1.13 always writes CRCs

    refused = {
        "legacy.pt": (state, "in the legacy format of torch.save", {"_use_new_zipfile_serialization": False}),
        "pickled_module.pt": (module, "pickles '__main__.Small'", {}),
        "lone_tensor.pt": (base, "holds a tensor, not a state dict", {}),
    }
    for name, (obj, message, kwargs) in refused.items():
        save(name, obj, **kwargs)
        manifest[name] = {"error": message}
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), os.path.join(directory, "torchscript.pt"))
    manifest["torchscript.pt"] = {"error": "a TorchScript or LibTorch archive"}
    rezip(os.path.join(directory, "module.pt"), os.path.join(directory, "deflated.pt"),
          zipfile.ZIP_DEFLATED)
    manifest["deflated.pt"] = {"error": "is compressed (method 8)"}

    if save_file is not None:
        safetensors = {
            "empty_first.safetensors": ({"a": tensor([0]), "b": tensor([4])}, None),
            "empty_last.safetensors": ({"a": tensor([4]), "b": tensor([0])}, None),
            "empty_between_dtypes.safetensors": (
                {"z": tensor([0, 3]), "b": tensor([4]), "c": tensor([2, 0], torch.int8),
                 "d": tensor([3], torch.float16)}, {"format": "pt", "note": "empty tensors"}),
            "empties_only.safetensors": ({"x": tensor([0]), "y": tensor([0, 5]), "z": tensor([3, 0, 2])}, None),
            "scalars.safetensors": ({"s": tensor([]), "e": tensor([0]), "t": tensor([], torch.int64)}, None),
            "huge_empty.safetensors": ({"h": torch.empty(2**62, 0, 2**62), "b": tensor([2])}, None),
            "every_dtype.safetensors": (
                {f"{code}_{kind}": tensor(shape, dtype) for dtype, code in SAFETENSORS.items()
                 for kind, shape in (("empty", [0]), ("full", [3, 2]), ("wide_empty", [2, 0, 2]))},
                {"format": "pt"}),
        }
        for name, (tensors, metadata) in safetensors.items():
            save_file(tensors, os.path.join(directory, name), metadata=metadata)
            manifest[name] = {k: describe(v) for k, v in tensors.items()}
        manifest["safetensors_shapes"] = safetensors_shapes()
    with open(os.path.join(directory, "manifest.json"), "w") as out:
        json.dump(manifest, out)


class Tied(torch.nn.Module):
    """Token ids [batch, tokens] to logits [batch * tokens, vocab]: the output layer is the
    embedding's weight (tied), as in language models."""

    def __init__(self, vocab=11, width=8, hidden=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.fc = torch.nn.Linear(width, hidden)
        self.norm = torch.nn.BatchNorm1d(hidden)
        self.ln = torch.nn.LayerNorm(hidden)
        self.proj = torch.nn.Linear(hidden, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids).reshape(-1, self.embed.embedding_dim)
        x = self.ln(torch.relu(self.norm(self.fc(x))))
        return self.head(self.proj(x))


def without_num_batches_tracked(state, directory):
    """State dicts without norm.num_batches_tracked, and what load_state_dict does with each
    into a Tied() whose counter is 5: with no version for the BatchNorm (no _metadata: a plain
    dict, safetensors) or version 1, _NormBase._load_from_state_dict puts the key in (torch >= 2.2
    the module's own counter, older torch a 0) and all keys match; with version 2 (what
    state_dict() records) the key is missing."""
    key = "norm.num_batches_tracked"
    versioned = collections.OrderedDict((k, v) for k, v in state.items() if k != key)
    versioned._metadata = state._metadata  # as state_dict() records it: BatchNorm's version 2
    assert versioned._metadata["norm"]["version"] == 2
    version1 = collections.OrderedDict(versioned)
    version1._metadata = collections.OrderedDict(state._metadata)
    version1._metadata["norm"] = {"version": 1}
    dicts = {"no_nbt_plain.pt": {k: v for k, v in versioned.items()},
             "no_nbt_v2.pt": versioned, "no_nbt_v1.pt": version1}
    for name, d in dicts.items():
        torch.save(d, os.path.join(directory, name))
    if save_file is not None:  # one name of the tied pair, as save_model keeps
        plain = {k: v.clone() for k, v in versioned.items() if k != "head.weight"}
        save_file(plain, os.path.join(directory, "no_nbt.safetensors"))
        dicts["no_nbt.safetensors"] = plain
    def load(model, name, strict):
        if name.endswith(".safetensors"):  # load_model: the tied name it left out is no miss
            return load_model(model, os.path.join(directory, name), strict=strict)
        report = model.load_state_dict(dicts[name], strict=strict)
        return report.missing_keys, report.unexpected_keys

    verdicts = {}
    for name in dicts:
        model = Tied()
        model.norm.num_batches_tracked.fill_(5)
        try:
            load(model, name, True)
            strict = "loaded"
        except RuntimeError as e:
            strict = str(e).splitlines()[-1].strip()
        model = Tied()
        model.norm.num_batches_tracked.fill_(5)
        missing, unexpected = load(model, name, False)
        verdicts[name] = {"strict": strict, "missing_keys": sorted(missing),
                          "unexpected_keys": sorted(unexpected),
                          "num_batches_tracked": model.norm.num_batches_tracked.item(),
                          "torch": torch.__version__}
    return verdicts


def trained(directory):
    torch.manual_seed(7)
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    ids = torch.randint(0, 11, (6, 5))
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(ids), ids.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    state = model.state_dict()
    torch.save(state, os.path.join(directory, "trained.pt"))
    if save_model is not None:
        save_model(model, os.path.join(directory, "trained.safetensors"))
    test_ids = torch.randint(0, 11, (4, 7))
    with torch.no_grad():
        logits = model(test_ids)
    torch.save({"ids": test_ids, "logits": logits}, os.path.join(directory, "outputs.pt"))
    # PyTorch's strict=False on the same model: a key dropped, one added.
    partial = dict(state)
    del partial["proj.bias"]
    partial["extra.weight"] = torch.zeros(2)
    report = Tied().load_state_dict(partial, strict=False)
    torch.save(partial, os.path.join(directory, "partial.pt"))
    manifest = {"state_dict_keys": list(state.keys()),
                "missing_keys": list(report.missing_keys),
                "unexpected_keys": list(report.unexpected_keys),
                "loss": loss.item(),
                "batchnorm": without_num_batches_tracked(state, directory)}
    with open(os.path.join(directory, "manifest.json"), "w") as out:
        json.dump(manifest, out)


def main(mode, directory):
    torch.set_num_threads(1)
    os.makedirs(directory, exist_ok=True)
    {"files": files, "trained": trained}[mode](directory)


if __name__ == "__main__":
    main(*sys.argv[1:])
