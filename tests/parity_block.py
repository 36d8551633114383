"""The block-scaled recipes composed in Python from torchao 0.18's emulated pieces, for
tests/test_parity_block.cpp to compare with mixprec's MixedFP8<MXFP8Scaling>,
<BlockwiseFP8Scaling> and <NVFP4Scaling> byte for byte and step for step.

    python parity_block.py casts INPUT OUTPUT
    python parity_block.py train MODEL INPUT OUTPUT RECIPE[,RECIPE...]

casts: INPUT holds tensors "x.NAME" (2-D, bf16 or fp32) and "e2m1" (fp32 values); OUTPUT gets,
per NAME, torchao's casts of x.NAME: MXFP8 with FLOOR and RCEIL (to_mx: mx_floor.NAME.data,
.scale, the bytes; .values, MXTensor.dequantize in x's dtype), NVFP4 (nvfp4_quantize with a
tensor scale: nvfp4.NAME.data, .scale, .tensor_scale; .values, NVFP4Tensor.dequantize in fp32),
and where the shape fits, blockwise fp8 (the torch_blockwise_* reference casts of torchao's
blockwise_fp8_training, read from its kernels.py, which needs Triton to import: bw_lhs, bw_rhs,
bw_weight); the NVFP4 casts torchao has only as Triton kernels, written here from the paper
(nvfp4_tiles: 16x16 tiles; nvfp4_sr: stochastic rounding with key "sr_key"; rht.NAME: x times
the random Hadamard matrix of "rht_key"); and e2m1: f32_to_f4_unpacked's codes.

train: MODEL is mlp or block (the C++ test's models, the same parameter names), INPUT the
initial weights (param.NAME), the data (x, y) and the settings (steps, batch, lr, seed). Each
RECIPE (mxfp8_floor, mxfp8_rceil, mxfp8_rceil_gw_hp, blockwise, nvfp4) trains the model from
the same weights: MixedO2's recipe (a bf16 model, fp32 masters stepped by LibTorch's AdamW
arithmetic, torch::optim::AdamW's ops one by one, rounded into the model after each step),
every linear layer but the block's head in the recipe:
  - MXFP8: torchao's own MXFP8Linear, KernelPreference.EMULATED (to_mx casts, bf16 products);
  - blockwise: torchao's reference casts (1x128 activations and gradients, 128x128 weights,
    128x1 for grad_weight's input), products of the operands dequantized to fp32 (code times
    reciprocal scale), one rounding to bf16 (torchao's products are CUDA only);
  - NVFP4 (arXiv 2509.25149): torchao's nvfp4_quantize for the casts to nearest, the 16x16
    weight tiles and the stochastic rounding of gradients written here, the random Hadamard
    matrix torchao's get_rht_matrix makes from this layer's signs, products of operands
    dequantized by NVFP4Tensor.dequantize(torch.float32), one rounding to bf16.
Random bits (NVFP4): element i of a cast rounds up where (hash32(i ^ key) >> 8) * 2^-24 is below
its distance to the lower neighbour over the gap; key = rounding_key(seed, draw, 2 * layer +
cast), draw counting the layer's backward passes, cast 0 for grad_input's gradient and 1 for
grad_weight's; the Hadamard signs from rounding_key(seed, 2^64 - 1, layer): mixprec's
definitions (fp8/nvfp4.hpp, optim/lean_kernels.hpp), restated here in numpy.
OUTPUT: RECIPE.losses, .weights and .grads (fingerprints per step), RECIPE.first.logits and
.first.grad.NAME, and the casts of the first step, RECIPE.ops.LAYER.CAST.data / .scale /
.tensor_scale, each as the product reads it (its blocks along its last dimension).
"""
import ast
import math
import sys

import numpy as np
import torch

import torchao.prototype.blockwise_fp8_training as blockwise_package
import torchao.prototype.moe_training.mxfp8_linear as mxfp8_linear
import torchao.prototype.mx_formats.mx_tensor as mx_tensor
from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
from torchao.prototype.mx_formats.nvfp4_tensor import (
    NVFP4Tensor,
    nvfp4_quantize,
    per_tensor_amax_to_scale,
)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

MASK64 = (1 << 64) - 1


def _blockwise_references():
    """torchao's torch_blockwise_* reference casts, taken from kernels.py as written (the module
    imports Triton at its top, which a CPU wheel lacks)."""
    path = blockwise_package.__path__[0] + "/kernels.py"
    tree = ast.parse(open(path).read())
    wanted = {"torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs",
              "torch_blockwise_scale_weight_quant"}
    module = ast.Module(body=[n for n in tree.body
                              if isinstance(n, ast.FunctionDef) and n.name in wanted],
                        type_ignores=[])
    from typing import Tuple
    namespace = {"torch": torch, "Tuple": Tuple, "EPS": 1e-12, "e4m3_dtype": torch.float8_e4m3fn,
                 "FP8_E4M3_DTYPES": {torch.float8_e4m3fn, torch.float8_e4m3fnuz}}
    exec(compile(module, path, "exec"), namespace)
    return (namespace["torch_blockwise_scale_act_quant_lhs"],
            namespace["torch_blockwise_scale_act_quant_rhs"],
            namespace["torch_blockwise_scale_weight_quant"])


bw_lhs, bw_rhs, bw_weight = _blockwise_references()


# ---- mixprec's random bits, restated
def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def rounding_key(seed, step, tensor):
    return splitmix64((seed ^ splitmix64((step ^ splitmix64(tensor)) & MASK64)) & MASK64) & 0xFFFFFFFF


def hash32(x):
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def hadamard(seed, layer):
    key = rounding_key(seed, MASK64, layer)
    bits = hash32(np.arange(16, dtype=np.uint32) ^ np.uint32(key)) >> np.uint32(31)
    signs = tuple(-1 if b else 1 for b in bits.tolist())
    return get_rht_matrix(signs, "cpu", torch.float32, 16)


def with_hadamard(t, matrix):
    """Each 16 consecutive values of t's rows times the matrix, an fp32 product, to bf16."""
    return torch.mm(t.contiguous().reshape(-1, 16).float(), matrix).to(torch.bfloat16).reshape(t.shape)


# ---- NVFP4
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def tensor_scale(t):
    """torchao's per_tensor_amax_to_scale, 1 where it is 0 (an all-zero tensor)."""
    s = per_tensor_amax_to_scale(t.abs().max())
    return torch.where(s == 0, torch.ones_like(s), s)


def nvfp4_scaled(t, scale, tiles):
    """nvfp4_quantize's arithmetic (the e4m3 block scales and the values scaled and clamped to
    e2m1's range), with each 16x16 tile's amax in place of each block's under `tiles` (the
    paper's 2-D weight scaling)."""
    rows, columns = t.shape
    data = t.float().reshape(rows, -1, 16)
    max_abs = torch.amax(torch.abs(data), dim=-1)
    if tiles:
        max_abs = torch.amax(torch.abs(data).reshape(rows // 16, 16, columns // 16, 16), dim=(1, 3))
        max_abs = max_abs.repeat_interleave(16, 0)
    block_scale = max_abs / 6.0
    scales = torch.clamp(block_scale / scale, min=torch.finfo(torch.float8_e4m3fn).tiny, max=448.0)
    scales = scales.to(torch.float8_e4m3fn)
    reciprocal = (1.0 / scale) / scales.to(torch.float32)
    scaled = torch.clamp(data * reciprocal.unsqueeze(-1), -6.0, 6.0).reshape(rows, columns)
    return scales, scaled


def e2m1_stochastic(scaled, key):
    """Each value rounded up (in magnitude) to its upper e2m1 neighbour with probability its
    distance from the lower one over the gap, against hash32(i ^ key) >> 8 times 2^-24."""
    v = scaled.contiguous().reshape(-1).numpy()
    magnitude = np.abs(v)
    low = np.clip(np.searchsorted(E2M1, magnitude, side="right") - 1, 0, 7)
    high = np.minimum(low + 1, 7)
    gap = E2M1[high] - E2M1[low]
    with np.errstate(invalid="ignore", divide="ignore"):
        up = np.where(gap > 0, (magnitude - E2M1[low]) / np.where(gap > 0, gap, 1), 0).astype(np.float32)
    index = (np.arange(v.size, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
    uniform = (hash32(index ^ np.uint32(key)) >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
    codes = (low + ((uniform < up) & (gap > 0))).astype(np.uint8)
    codes |= np.signbit(v).astype(np.uint8) << 3
    nan = np.isnan(v)
    codes[nan] = f32_to_f4_unpacked(torch.from_numpy(v[nan].copy())).numpy()
    return torch.from_numpy(codes).reshape(scaled.shape)


def pack(codes):
    flat = codes.contiguous().reshape(-1)
    return (flat[::2] | (flat[1::2] << 4)).reshape(codes.shape[0], codes.shape[1] // 2)


def nvfp4_cast(t, tiles=False, key=None):
    """(packed codes, e4m3 scales, tensor scale): torchao's nvfp4_quantize where it has the
    cast (1x16 blocks, to nearest), the paper's parts written here otherwise."""
    t = t.contiguous()
    scale = tensor_scale(t)
    if not tiles and key is None:
        scales, data = nvfp4_quantize(t, 16, scale)
        return data, scales, scale
    scales, scaled = nvfp4_scaled(t, scale, tiles)
    codes = f32_to_f4_unpacked(scaled) if key is None else e2m1_stochastic(scaled, key)
    return pack(codes), scales, scale


def nvfp4_values(q):
    data, scales, scale = q
    return NVFP4Tensor(data, scales, 16, torch.bfloat16, per_tensor_scale=scale).dequantize(torch.float32)


# ---- blockwise fp8: operands as (e4m3 codes, fp32 reciprocal scales), blocks along the last dim
def bw_values(q):
    data, scale = q
    rows, columns = data.shape
    if scale.shape[0] == rows:
        factor = scale.repeat_interleave(128, 1)
    else:
        factor = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return data.float() * factor


def bw_cast_rows_of(x):
    """x's 128x1 cast (grad_weight's input), as the product reads it: x^T with 1x128 blocks."""
    data, scale = bw_rhs(x.contiguous(), 128)
    return data.t().contiguous(), scale.t().contiguous()


# ---- the casts of one step, recorded where they are made
recorded = {}
current = {"recipe": None, "layer": None, "phase": None, "casts": 0, "record": False}


def record(name, data, scale, scale_tensor=None):
    if not current["record"]:
        return
    key = f"{current['recipe']}.ops.{current['layer']}.{name}"
    if key + ".data" in recorded:
        return
    if scale.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        scale = scale.view(torch.uint8)
    recorded[key + ".data"] = data.contiguous().view(torch.uint8).clone()
    recorded[key + ".scale"] = scale.contiguous().clone()
    if scale_tensor is not None:
        recorded[key + ".tensor_scale"] = scale_tensor.clone()


MX_CASTS = ["input", "weight", "grad_output", "weight_for_grad_input",
            "grad_output_for_grad_weight", "input_for_grad_weight"]
original_to_mx = mx_tensor.to_mx


def recording_to_mx(data_hp, elem_dtype, block_size, scaling_mode=ScaleCalculationMode.FLOOR,
                    is_swizzled_scales=False):
    scale, data = original_to_mx(data_hp, elem_dtype, block_size, scaling_mode, is_swizzled_scales)
    if current["record"]:
        index = current["casts"] + (0 if current["phase"] == "forward" else 2)
        current["casts"] += 1
        record(MX_CASTS[index], data, scale.view(torch.uint8))
    return scale, data


original_mx_forward = mxfp8_linear.mx_mm.forward
original_mx_backward = mxfp8_linear.mx_mm.backward


def recording_mx_forward(ctx, *args):
    ctx.layer = current["layer"]
    current.update(phase="forward", casts=0)
    return original_mx_forward(ctx, *args)


def recording_mx_backward(ctx, *args):
    current.update(layer=ctx.layer, phase="backward", casts=0)
    return original_mx_backward(ctx, *args)


class BlockwiseMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.layer = layer
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        qx = bw_lhs(x2, 128)
        qw = bw_weight(weight.contiguous(), 128)
        record("input", *qx)
        record("weight", *qw)
        ctx.save_for_backward(x, weight)
        out = torch.mm(bw_values(qx), bw_values(qw).t()).to(x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        current["layer"] = ctx.layer
        g = grad.reshape(-1, weight.shape[0]).contiguous()
        x2 = x.reshape(-1, weight.shape[1])
        qg = bw_lhs(g, 128)
        qwt = bw_weight(weight.t().contiguous(), 128)
        record("grad_output", *qg)
        record("weight_for_grad_input", *qwt)
        grad_x = torch.mm(bw_values(qg), bw_values(qwt).t()).to(x.dtype).reshape(x.shape)
        qgt = bw_lhs(g.t().contiguous(), 128)
        qxt = bw_cast_rows_of(x2)
        record("grad_output_for_grad_weight", *qgt)
        record("input_for_grad_weight", *qxt)
        grad_w = torch.mm(bw_values(qgt), bw_values(qxt).t()).to(weight.dtype)
        return grad_x, grad_w, None


class Nvfp4Mm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module):
        ctx.module = module
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        qx = nvfp4_cast(x2)
        qw = nvfp4_cast(weight, tiles=True)
        record("input", *qx)
        record("weight", *qw)
        ctx.save_for_backward(x, weight)
        out = torch.mm(nvfp4_values(qx), nvfp4_values(qw).t()).to(x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        m = ctx.module
        current["layer"] = m.layer_name
        seed, layer, draw = m.seed, m.index, m.draws
        g = grad.reshape(-1, weight.shape[0]).contiguous()
        x2 = x.reshape(-1, weight.shape[1])
        qg = nvfp4_cast(g, key=rounding_key(seed, draw, 2 * layer))
        qwt = nvfp4_cast(weight.t().contiguous(), tiles=True)
        record("grad_output", *qg)
        record("weight_for_grad_input", *qwt)
        grad_x = torch.mm(nvfp4_values(qg), nvfp4_values(qwt).t()).to(x.dtype).reshape(x.shape)
        matrix = hadamard(seed, layer)
        qgt = nvfp4_cast(with_hadamard(g.t().contiguous(), matrix), key=rounding_key(seed, draw, 2 * layer + 1))
        qxt = nvfp4_cast(with_hadamard(x2.t().contiguous(), matrix))
        record("grad_output_for_grad_weight", *qgt)
        record("input_for_grad_weight", *qxt)
        grad_w = torch.mm(nvfp4_values(qgt), nvfp4_values(qxt).t()).to(weight.dtype)
        m.draws += 1
        return grad_x, grad_w, None


class RecipeLinear(torch.nn.Linear):
    """nn.Linear whose product is one of the Functions above, the bias added after in the
    output's dtype (as torchao's MXFP8Linear and mixprec's Float8Linear)."""

    def forward(self, x):
        if self.recipe == "blockwise":
            out = BlockwiseMm.apply(x, self.weight, self.layer_name)
        else:
            out = Nvfp4Mm.apply(x, self.weight, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(128, 128)
        self.fc2 = torch.nn.Linear(128, 128)
        self.head = torch.nn.Linear(128, 4)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))


class Block(torch.nn.Module):
    """A pre-norm transformer block (two heads) and a linear head on the mean over positions."""

    def __init__(self, d=128, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d)
        self.query = torch.nn.Linear(d, d)
        self.key = torch.nn.Linear(d, d)
        self.value = torch.nn.Linear(d, d)
        self.proj = torch.nn.Linear(d, d)
        self.norm2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        h = self.norm1(x)
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        attended = torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attended)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(x.mean(1))


def convert(model, recipe, seed):
    """Every Linear but the head in the recipe, sharing the model's parameters."""
    index = 0
    for name, module in list(model.named_children()):
        if not isinstance(module, torch.nn.Linear) or name == "head":
            continue
        if recipe.startswith("mxfp8"):
            mode = ScaleCalculationMode.FLOOR if "floor" in recipe else ScaleCalculationMode.RCEIL
            new = mxfp8_linear.MXFP8Linear(module.in_features, module.out_features,
                                           kernel_preference=KernelPreference.EMULATED,
                                           scale_calculation_mode=mode,
                                           wgrad_with_hp=recipe.endswith("gw_hp"))
        else:
            new = RecipeLinear(module.in_features, module.out_features)
            new.recipe = recipe
        new.weight, new.bias = module.weight, module.bias
        new.layer_name, new.index, new.seed, new.draws = name, index, seed, 0
        new.register_forward_pre_hook(lambda m, inputs: current.update(layer=m.layer_name))
        setattr(model, name, new)
        index += 1


def fingerprint(tensors):
    """sum(x_i * (i % 251 + 1)) over the tensors flattened in order, in fp64 (test_parity.cpp's)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return (flat * (torch.arange(flat.numel(), dtype=torch.float64) % 251 + 1)).sum().item()


class LibTorchAdamW:
    """torch::optim::AdamW's step, op for op (torch/csrc/api/src/optim/adamw.cpp): Python's
    AdamW updates the moments with lerp_ and ** 0.5 and parts from it in the last bit."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.params, self.lr, self.betas, self.eps, self.wd = params, lr, betas, eps, weight_decay
        self.state = [None] * len(params)

    @torch.no_grad()
    def step(self):
        beta1, beta2 = self.betas
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.wd != 0:
                p.mul_(1 - self.lr * self.wd)
            if self.state[i] is None:
                self.state[i] = [0, torch.zeros_like(p), torch.zeros_like(p)]
            state = self.state[i]
            state[0] += 1
            step, exp_avg, exp_avg_sq = state
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
            p.addcdiv_(exp_avg, denom, value=-(self.lr / bias_correction1))


def train(model_kind, data, recipe, result):
    model = Mlp() if model_kind == "mlp" else Block()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    names = [name for name, _ in model.named_parameters()]
    masters = [p.detach().clone().float() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    convert(model, recipe, int(data["seed"]))
    optimizer = LibTorchAdamW(masters, lr=float(data["lr"]))
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    losses, weights, grads = [], [], []
    current["recipe"] = recipe
    for step in range(steps):
        start = (step * batch) % x.shape[0]
        xb, yb = x[start:start + batch].to(torch.bfloat16), y[start:start + batch]
        for p in model.parameters():
            p.grad = None
        current["record"] = step == 0
        logits = model(xb)
        loss = torch.nn.functional.cross_entropy(logits.float(), yb)
        loss.backward()
        current["record"] = False
        if step == 0:
            result[recipe + ".first.logits"] = logits.detach().clone()
            for name, p in zip(names, model.parameters()):
                result[recipe + ".first.grad." + name] = p.grad.detach().clone()
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
        losses.append(loss.item())
        weights.append(fingerprint(model.parameters()))
        grads.append(fingerprint(p.grad for p in model.parameters()))
    result[recipe + ".losses"] = torch.tensor(losses, dtype=torch.float64)
    result[recipe + ".weights"] = torch.tensor(weights, dtype=torch.float64)
    result[recipe + ".grads"] = torch.tensor(grads, dtype=torch.float64)


def casts(data):
    out = {}
    for key, x in data.items():
        if not key.startswith("x."):
            continue
        name = key[2:]
        rows, columns = x.shape
        for mode, label in ((ScaleCalculationMode.FLOOR, "mx_floor"), (ScaleCalculationMode.RCEIL, "mx_rceil")):
            if columns % 32 == 0:
                scale, codes = original_to_mx(x.contiguous(), torch.float8_e4m3fn, 32, mode)
                out[f"{label}.{name}.data"] = codes.view(torch.uint8).clone()
                out[f"{label}.{name}.scale"] = scale.view(torch.uint8).clone()
                tensor = mx_tensor.MXTensor(codes, scale, torch.float8_e4m3fn, 32, x.dtype,
                                            KernelPreference.EMULATED, None, False)
                out[f"{label}.{name}.values"] = tensor.dequantize(x.dtype)
        if columns % 16 == 0:
            q = nvfp4_cast(x)
            out[f"nvfp4.{name}.data"], out[f"nvfp4.{name}.scale"] = q[0], q[1].view(torch.uint8)
            out[f"nvfp4.{name}.tensor_scale"] = q[2]
            out[f"nvfp4.{name}.values"] = nvfp4_values(q)
            sr = nvfp4_cast(x, key=int(data["sr_key"]))
            out[f"nvfp4_sr.{name}.data"], out[f"nvfp4_sr.{name}.scale"] = sr[0], sr[1].view(torch.uint8)
            out[f"rht.{name}"] = with_hadamard(x, hadamard(int(data["rht_seed"]), 0))
            if rows % 16 == 0:
                t = nvfp4_cast(x, tiles=True)
                out[f"nvfp4_tiles.{name}.data"], out[f"nvfp4_tiles.{name}.scale"] = t[0], t[1].view(torch.uint8)
        if columns % 128 == 0:
            codes, scale = bw_lhs(x.contiguous(), 128)
            out[f"bw_lhs.{name}.data"], out[f"bw_lhs.{name}.scale"] = codes.view(torch.uint8), scale.contiguous()
        if rows % 128 == 0 and columns % 128 == 0:
            codes, scale = bw_rhs(x.contiguous(), 128)
            out[f"bw_rhs.{name}.data"] = codes.contiguous().view(torch.uint8)
            out[f"bw_rhs.{name}.scale"] = scale.contiguous()
            codes, scale = bw_weight(x.contiguous(), 128)
            out[f"bw_weight.{name}.data"], out[f"bw_weight.{name}.scale"] = codes.view(torch.uint8), scale
    out["e2m1"] = f32_to_f4_unpacked(data["e2m1"].float())
    return out


def main(mode, *args):
    torch.set_num_threads(1)
    if mode == "casts":
        input_path, output_path = args
        torch.save(casts(torch.load(input_path, weights_only=False)), output_path)
        return
    model_kind, input_path, output_path, recipes = args
    data = torch.load(input_path, weights_only=False)
    mx_tensor.to_mx = recording_to_mx
    mxfp8_linear.mx_mm.forward = staticmethod(recording_mx_forward)
    mxfp8_linear.mx_mm.backward = staticmethod(recording_mx_backward)
    result = {}
    for recipe in recipes.split(","):
        train(model_kind, data, recipe, result)
    result.update(recorded)
    torch.save(result, output_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
