"""torchao's float8 training recipes, step by step, for tests/test_parity.cpp to compare with
mixprec's MixedFP8<TensorwiseScaling>, <RowwiseScaling> and <RowwiseScalingWithGwHp>.

    python parity_fp8.py MODEL INPUT OUTPUT RECIPE[,RECIPE...]

MODEL is mlp or block (the C++ test's models, the same parameter names). INPUT is a
torch::pickle_save dict from the C++ side: the initial weights (param.NAME), the data (x, y) and
the hyperparameters (steps, batch, lr). RECIPE is a name of torchao's
Float8LinearConfig.from_recipe_name (tensorwise: dynamic tensorwise scaling, e4m3 input and
weight, e5m2 grad_output; rowwise; rowwise_with_gw_hp), emulate=True; each recipe trains the
same model from the same weights in this one process. The recipe: the model in bf16 with its
linear layers converted by torchao (the block keeps its head out, as mixprec's precision map
does), fp32 master weights stepped by AdamW and rounded into the model after each step:
MixedO2's recipe. OUTPUT gets a torch.save dict, each key behind its recipe's name and a dot:
losses (fp64, one per step), fingerprints of the bf16 weights after each step and of each
step's gradients (weights, grads; see fingerprint), the first step's logits and gradients
(first.logits, first.grad.NAME) and the fp8 operands each converted layer cast in it
(ops.LAYER.CAST.scale, ops.LAYER.CAST.bytes as uint8), in mixprec's layout: input [rows, in],
weight [out, in], grad_output [rows, out], a rowwise scale [rows, 1] or [1, columns].
CAST is input, weight (the forward product's), grad_output, weight_for_grad_input (grad_input's),
grad_output_for_grad_weight, input_for_grad_weight (grad_weight's), as torchao casts them.
"""
import dataclasses
import math
import sys

import torch
import torchao.float8.float8_linear as float8_linear
from torchao.float8 import Float8LinearConfig, convert_to_float8_training


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))


class Block(torch.nn.Module):
    """A pre-norm transformer block (two heads) and a linear head on the mean over positions."""

    def __init__(self, d=32, heads=2):
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


# The fp8 operands of the first step, recorded where torchao casts them: in the forward pass
# input, then weight; in the backward pass grad_output and weight for grad_input, then
# grad_output and input for grad_weight (a recipe that computes a product in high precision
# casts nothing for it).
operands = {}
current = {"layer": None, "phase": None, "grad_outputs": 0}
original_cast = float8_linear.hp_tensor_to_float8_dynamic
original_forward = float8_linear.matmul_with_hp_or_float8_args.forward
original_backward = float8_linear.matmul_with_hp_or_float8_args.backward


def cast_name(role):
    if current["phase"] == "forward":
        return {"INPUT": "input", "WEIGHT": "weight"}[role]
    if role == "GRAD_OUTPUT":
        current["grad_outputs"] += 1
        return "grad_output" if current["grad_outputs"] == 1 else "grad_output_for_grad_weight"
    return {"WEIGHT": "weight_for_grad_input", "INPUT": "input_for_grad_weight"}[role]


def recording_cast(hp_tensor, float8_dtype, linear_mm_config, *args, **kwargs):
    result = original_cast(hp_tensor, float8_dtype, linear_mm_config, *args, **kwargs)
    role = kwargs["gemm_input_role"].name
    key = f"{current['recipe']}.ops.{current['layer']}.{cast_name(role)}"
    if current["layer"] is not None and key + ".scale" not in operands:
        data, scale = result._data, result._scale
        if data.dim() > 2:  # a 3-D input, cast before its reshape to 2-D
            data = data.reshape(-1, data.shape[-1])
            scale = scale.reshape(-1, scale.shape[-1]) if scale.dim() > 1 else scale
        if role == "WEIGHT":  # torchao casts weight.t(): the weight's own [out, in] order
            data = data.t()
            scale = scale.t() if scale.dim() == 2 else scale
        if scale.dim() < 2:
            scale = scale.reshape(())
        operands[key + ".scale"] = scale.detach().contiguous().clone()
        operands[key + ".bytes"] = data.contiguous().view(torch.uint8).clone()
    return result


def recording_forward(ctx, *args):
    ctx.layer = current["layer"]
    current["phase"] = "forward"
    return original_forward(ctx, *args)


def recording_backward(ctx, *args):
    current.update(layer=ctx.layer, phase="backward", grad_outputs=0)
    return original_backward(ctx, *args)


def fingerprint(tensors):
    """sum(x_i * (i % 251 + 1)) over the tensors, flattened in order, in fp64: the same ATen
    ops as test_parity.cpp's, one thread, so equal tensors give equal fingerprints, and a
    difference of one bf16 ulp anywhere gives another."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return (flat * (torch.arange(flat.numel(), dtype=torch.float64) % 251 + 1)).sum().item()


def train(model_kind, data, recipe, result):
    model = Mlp() if model_kind == "mlp" else Block()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    names = [name for name, _ in model.named_parameters()]
    masters = [p.detach().clone().float() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    keep_head = model_kind == "block"
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: not (keep_head and fqn == "head"))
    for name, module in model.named_modules():
        if isinstance(module, float8_linear.Float8Linear):
            module.register_forward_pre_hook(lambda m, inputs, name=name: current.update(layer=name))
    # foreach=False: the per-tensor loop of LibTorch's torch::optim::AdamW.
    optimizer = torch.optim.AdamW(masters, lr=float(data["lr"]), foreach=False)
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    losses, weights, grads = [], [], []
    current["recipe"] = recipe
    for step in range(steps):
        start = (step * batch) % x.shape[0]
        xb, yb = x[start:start + batch].to(torch.bfloat16), y[start:start + batch]
        for p in model.parameters():
            p.grad = None
        logits = model(xb)
        loss = torch.nn.functional.cross_entropy(logits.float(), yb)
        loss.backward()
        if step == 0:
            current["layer"] = None
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


def main(model_kind, input_path, output_path, recipes):
    torch.set_num_threads(1)
    data = torch.load(input_path, weights_only=False)
    float8_linear.hp_tensor_to_float8_dynamic = recording_cast
    float8_linear.matmul_with_hp_or_float8_args.forward = staticmethod(recording_forward)
    float8_linear.matmul_with_hp_or_float8_args.backward = staticmethod(recording_backward)
    result = {}
    for recipe in recipes.split(","):
        train(model_kind, data, recipe, result)
    result.update(operands)
    torch.save(result, output_path)


if __name__ == "__main__":
    main(*sys.argv[1:5])
