"""torchao's float8 training recipe, step by step, for tests/test_parity.cpp to compare with
mixprec's MixedFP8<TensorwiseScaling>.

    python parity_fp8.py MODEL INPUT OUTPUT

MODEL is mlp or block (the C++ test's models, the same parameter names). INPUT is a
torch::pickle_save dict from the C++ side: the initial weights (param.NAME), the data (x, y) and
the hyperparameters (steps, batch, lr). The recipe: the model in bf16 with its linear layers
converted by torchao (Float8LinearConfig(emulate=True): dynamic tensorwise scaling, e4m3 input and
weight, e5m2 grad_output; the block keeps its head out, as mixprec's precision map does), fp32
master weights stepped by AdamW and rounded into the model after each step: MixedO2's recipe.
OUTPUT gets a torch.save dict: losses (fp64, one per step), the first step's logits and
gradients (first.logits, first.grad.NAME) and the fp8 operands each converted layer used in it
(ops.LAYER.ROLE.scale, ops.LAYER.ROLE.bytes as uint8).
"""
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


# The fp8 operands of the first step, recorded where torchao casts them.
operands = {}
current = {"layer": None}
original_cast = float8_linear.hp_tensor_to_float8_dynamic
original_forward = float8_linear.matmul_with_hp_or_float8_args.forward
original_backward = float8_linear.matmul_with_hp_or_float8_args.backward
ROLES = {"INPUT": "input", "WEIGHT": "weight", "GRAD_OUTPUT": "grad_output"}


def recording_cast(hp_tensor, float8_dtype, linear_mm_config, *args, **kwargs):
    result = original_cast(hp_tensor, float8_dtype, linear_mm_config, *args, **kwargs)
    role = ROLES[kwargs["gemm_input_role"].name]
    key = f"ops.{current['layer']}.{role}"
    if current["layer"] is not None and key + ".scale" not in operands:
        # torchao casts weight.t(): its bytes in the weight's own [out, in] order.
        data = result._data.t() if role == "weight" else result._data
        operands[key + ".scale"] = result._scale.detach().clone().reshape(())
        operands[key + ".bytes"] = data.contiguous().view(torch.uint8).clone()
    return result


def recording_forward(ctx, *args):
    ctx.layer = current["layer"]
    return original_forward(ctx, *args)


def recording_backward(ctx, *args):
    current["layer"] = ctx.layer
    return original_backward(ctx, *args)


def main(model_kind, input_path, output_path):
    torch.set_num_threads(1)
    data = torch.load(input_path, weights_only=False)
    model = Mlp() if model_kind == "mlp" else Block()
    model.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    names = [name for name, _ in model.named_parameters()]
    masters = [p.detach().clone().float() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    keep_head = model_kind == "block"
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=lambda m, fqn: not (keep_head and fqn == "head"))
    float8_linear.hp_tensor_to_float8_dynamic = recording_cast
    float8_linear.matmul_with_hp_or_float8_args.forward = staticmethod(recording_forward)
    float8_linear.matmul_with_hp_or_float8_args.backward = staticmethod(recording_backward)
    for name, module in model.named_modules():
        if isinstance(module, float8_linear.Float8Linear):
            module.register_forward_pre_hook(lambda m, inputs, name=name: current.update(layer=name))
    # foreach=False: the per-tensor loop of LibTorch's torch::optim::AdamW.
    optimizer = torch.optim.AdamW(masters, lr=float(data["lr"]), foreach=False)
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    losses, result = [], {}
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
            result["first.logits"] = logits.detach().clone()
            for name, p in zip(names, model.parameters()):
                result["first.grad." + name] = p.grad.detach().clone()
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
        losses.append(loss.item())
    result["losses"] = torch.tensor(losses, dtype=torch.float64)
    result.update(operands)
    torch.save(result, output_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
