"""torchao 0.18's low-bit optimizer states, for tests/optim/test_quantized_moments.cpp to compare
with mixprec's block formats byte for byte.

    python quantized_moments.py MODE INPUT OUTPUT

INPUT is a torch::pickle_save dict from the C++ side; OUTPUT gets a torch.save dict.

MODE codec: INPUT holds tensors x.K (fp32) and `block8`, `block4`, `blockfp8`. For each x.K,
each format (q8, q4, fp8) and signedness (s, u; fp8 has none), torchao's optimizer-state tensor
(OptimState8bit, OptimState4bit, OptimStateFp8) takes x.K through copy_ as its step does:
OUTPUT gets FMT.SIGN.K.codes (uint8: 4-bit codes packed as torchao packs them; fp8 codes as
their bytes), FMT.SIGN.K.scale and FMT.SIGN.K.decoded (its dequantize()); and the maps
(map.q8.s, map.q8.u, map.q4.s, map.q4.u) and e4m3.K (x.K.to(float8_e4m3fn) as bytes).

MODE adam: INPUT holds the weights p.K (fp32 or bf16), the gradients g.STEP.K, `optimizer` (a
name in torchao.optim: AdamW8bit, Adam4bit, ...), `lr`, `beta1`, `beta2`, `eps`,
`weight_decay`, `amsgrad`, `block`, `steps`, and for bf16 weights `sr_keys` (int64 [steps, K]):
torchao's step with bf16_stochastic_round=True, its random rounding replaced by mixprec's
(bits + hash32((i ^ key)) >> 16, hash32 Wellons' lowbias32), so that the two round alike.
The step runs eagerly: torch.compile is the identity (the arithmetic is the same; compiling
would spend a minute in the C++ compiler). OUTPUT gets, after each step S and for each tensor
K: S.K.p, and per moment (exp_avg, exp_avg_sq, max_exp_avg_sq) S.K.NAME.codes and .scale for a
quantized one, S.K.NAME for a plain one.

MODE train: the C++ test's model trained by torchao's optimizer in bf16 with stochastic
rounding (mixprec's), step by step (train()).
"""
import sys

import torch

# Before torchao.optim is imported: its step calls torch.compile(single_param_adam, ...).
torch.compile = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)

import torchao.optim  # noqa: E402
import torchao.optim.adam as adam  # noqa: E402
from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402
from torchao.optim.subclass_fp8 import OptimStateFp8  # noqa: E402

MASK32 = 0xFFFFFFFF


def codes_of(state):
    if isinstance(state, OptimStateFp8):
        return state.codes.view(torch.uint8).reshape(-1)
    return state.codes.reshape(-1)


def codec(data):
    out = {}
    blocks = {"q8": int(data["block8"]), "q4": int(data["block4"]), "fp8": int(data["blockfp8"])}
    keys = sorted(k for k in data if k.startswith("x."))
    for key in keys:
        x = data[key].float()
        k = key[2:]
        for fmt, block in blocks.items():
            for sign in (["s", "u"] if fmt != "fp8" else ["s"]):
                signed = sign == "s"
                if fmt == "q8":
                    state = OptimState8bit.zeros(x.shape, signed, block)
                elif fmt == "q4":
                    state = OptimState4bit.zeros(x.shape, signed, block)
                else:
                    state = OptimStateFp8.zeros(x.shape, block)
                state.copy_(x)
                out[f"{fmt}.{sign}.{k}.codes"] = codes_of(state).clone()
                out[f"{fmt}.{sign}.{k}.scale"] = state.scale.clone()
                out[f"{fmt}.{sign}.{k}.decoded"] = state.dequantize().reshape(-1).clone()
        out[f"e4m3.{k}"] = x.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1).clone()
    from torchao.optim import subclass_4bit, subclass_8bit
    out["map.q8.s"] = torch.tensor(subclass_8bit.get_qmap_signed(), dtype=torch.float32)
    out["map.q8.u"] = torch.tensor(subclass_8bit.get_qmap_unsigned(), dtype=torch.float32)
    out["map.q4.s"] = torch.tensor(subclass_4bit.get_qmap_signed(), dtype=torch.float32)
    out["map.q4.u"] = torch.tensor(subclass_4bit.get_qmap_unsigned(), dtype=torch.float32)
    return out


def hash32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def mixprec_sr(key):
    """mixprec's stochastic rounding of fp32 to bf16 with `key` (lean_kernels.hpp)."""
    def round_(x):
        bits = x.reshape(-1).view(torch.int32).to(torch.int64) & MASK32
        index = torch.arange(bits.numel(), dtype=torch.int64)
        noise = hash32(index ^ key) >> 16
        finite = (bits & 0x7F800000) != 0x7F800000
        rounded = (bits + torch.where(finite, noise, torch.zeros_like(noise))) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = torch.where(nan, torch.full_like(rounded, 0x7FC0), rounded)
        rounded = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded)
        return rounded.to(torch.int16).view(torch.bfloat16).reshape(x.shape)
    return round_


def state_entries(prefix, state):
    out = {}
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        if name not in state:
            continue
        t = state[name]
        if isinstance(t, (OptimState8bit, OptimState4bit, OptimStateFp8)):
            out[f"{prefix}.{name}.codes"] = codes_of(t).clone()
            out[f"{prefix}.{name}.scale"] = t.scale.clone()
        else:
            out[f"{prefix}.{name}"] = t.clone()
    return out


def adam_steps(data):
    count = len([k for k in data if k.startswith("p.")])
    params = [torch.nn.Parameter(data[f"p.{k}"].clone()) for k in range(count)]
    bf16 = params[0].dtype == torch.bfloat16
    cls = getattr(torchao.optim, data["optimizer"])
    optimizer = cls(params, lr=float(data["lr"]), betas=(float(data["beta1"]), float(data["beta2"])),
                    eps=float(data["eps"]), weight_decay=float(data["weight_decay"]),
                    amsgrad=bool(data["amsgrad"]), block_size=int(data["block"]),
                    bf16_stochastic_round=bf16)
    out = {}
    keys = []
    if bf16:
        sr_keys = data["sr_keys"]
        original = adam._fp32_to_bf16_sr

        def rounding(x):
            return mixprec_sr(int(keys.pop(0)) & MASK32)(x)
        adam._fp32_to_bf16_sr = rounding
    for step in range(int(data["steps"])):
        for k, p in enumerate(params):
            p.grad = data[f"g.{step}.{k}"].clone()
        if bf16:
            keys[:] = [int(v) for v in sr_keys[step].tolist()]
        optimizer.step()
        for k, p in enumerate(params):
            out[f"{step}.{k}.p"] = p.detach().clone()
            out.update(state_entries(f"{step}.{k}", optimizer.state[p]))
    if bf16:
        adam._fp32_to_bf16_sr = original
    return out


class Net(torch.nn.Module):
    """tests/optim/test_quantized_trainer.cpp's Net: the same parameters, names and forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 128)
        self.ln = torch.nn.LayerNorm(128)
        self.fc2 = torch.nn.Linear(128, 40)
        self.fc3 = torch.nn.Linear(40, 4)
        self.fc4 = torch.nn.Linear(128, 33)

    def forward(self, x):
        h = self.ln(torch.relu(self.fc1(x)))
        return self.fc3(torch.relu(self.fc2(h))) + self.fc4(h).narrow(1, 0, 4)


def train(data):
    """MODE train: Net (its weights param.NAME) cast to bf16, trained by torchao's `optimizer`
    with bf16_stochastic_round=True (mixprec's rounding, keys sr_keys[step, k] for the k-th
    parameter) on batches x.STEP, y.STEP; OUTPUT: loss.STEP, and after the last step p.NAME
    and the moments of each parameter (as state_entries names them, behind NAME)."""
    torch.set_num_threads(1)  # as the C++ side: the gradients reduced in one order
    model = Net()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    model = model.to(torch.bfloat16)
    cls = getattr(torchao.optim, data["optimizer"])
    optimizer = cls(model.parameters(), lr=float(data["lr"]),
                    weight_decay=float(data["weight_decay"]), bf16_stochastic_round=True)
    keys = []
    original = adam._fp32_to_bf16_sr
    adam._fp32_to_bf16_sr = lambda x: mixprec_sr(int(keys.pop(0)) & MASK32)(x)
    out = {}
    for step in range(int(data["steps"])):
        keys[:] = [int(v) for v in data["sr_keys"][step].tolist()]
        optimizer.zero_grad()
        x, y = data[f"x.{step}"], data[f"y.{step}"]
        loss = torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y)
        loss.backward()
        optimizer.step()
        out[f"loss.{step}"] = loss.detach().clone()
    adam._fp32_to_bf16_sr = original
    for name, p in model.named_parameters():
        out[f"p.{name}"] = p.detach().clone()
        out.update(state_entries(name, optimizer.state[p]))
    return out


def main():
    mode, input_path, output_path = sys.argv[1:4]
    data = torch.load(input_path, weights_only=False)
    if mode == "codec":
        out = codec(data)
    elif mode == "adam":
        out = adam_steps(data)
    elif mode == "train":
        out = train(data)
    else:
        raise SystemExit(f"unknown mode {mode}")
    torch.save(out, output_path)


if __name__ == "__main__":
    main()
