"""Python's torch.utils.checkpoint(use_reentrant=False) on the model of
tests/recompute/test_recompute.cpp, for its parity case to compare against.

    python parity_checkpoint.py INPUT OUTPUT [MODES]

INPUT: a torch::pickle_save dict from the C++ side: the initial weights (param.NAME) and
buffers (buffer.NAME), the input x, the labels y and the seed of the dropout stream. For each
mode (fp32; bf16: torch.autocast on the CPU) and each way (plain; checkpoint: every block through
torch.utils.checkpoint with use_reentrant=False), from those weights: one forward pass with the
random generator seeded, cross-entropy, backward outside autocast. MODES: a comma-separated
subset of fp32,bf16 (default both; torch 1.13's norms cannot read bf16 with fp32 weights). OUTPUT gets one line per
tensor, "MODE WAY NAME v1 v2 ...": the loss, x's gradient, each parameter's gradient and each
buffer after the step, every value as repr() of a Python float (exact for fp32 and bf16).

    python parity_checkpoint.py - OUTPUT misuse

What torch.utils.checkpoint(use_reentrant=False) does when the block's state changes between the
forward pass and backward (a module switched to eval() or train(), a captured number or tensor
changed, a parameter stepped), on models users build: an encoder layer with dropout, a conv
block with BatchNorm, Linear layers. One line per case, "misuse CASE OUTCOME DIFF": OUTCOME is
CheckpointError (its recompute check), another exception's type, or "gradient"; DIFF the largest
difference of the gradients (input's and parameters') from those of the same run without the
change, nan where it raised.
"""
import sys

import torch
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    # The C++ Block: the same parameter names, the same ops (F.linear, batch_norm, relu,
    # dropout, layer_norm).
    def __init__(self, d):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, d)
        self.norm = torch.nn.BatchNorm1d(d)
        self.drop = torch.nn.Dropout(0.25)
        self.fc2 = torch.nn.Linear(d, d)
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + self.fc2(self.drop(torch.relu(self.norm(self.fc1(x))))))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("in", torch.nn.Linear(16, 32))  # `in` is a keyword: by name
        self.blocks = torch.nn.ModuleList([Block(32), Block(32)])
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x, way):
        h = getattr(self, "in")(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if way == "checkpoint" else block(h)
        return self.head(h)


def write(out, mode, way, name, tensor):
    values = tensor.detach().double().reshape(-1).tolist()
    out.write(f"{mode} {way} {name} " + " ".join(repr(v) for v in values) + "\n")


def main(input_path, output_path, modes="fp32,bf16"):
    torch.set_num_threads(1)
    data = torch.load(input_path, weights_only=False)
    state = {k[len("param."):]: v for k, v in data.items() if k.startswith("param.")}
    state.update({k[len("buffer."):]: v for k, v in data.items() if k.startswith("buffer.")})
    with open(output_path, "w") as out:
        for mode in modes.split(","):
            for way in ("plain", "checkpoint"):
                model = Net()
                model.load_state_dict(state)
                x = data["x"].clone().requires_grad_()
                torch.manual_seed(int(data["seed"]))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                    logits = model(x, way)
                loss = torch.nn.functional.cross_entropy(logits.float(), data["y"])
                loss.backward()
                write(out, mode, way, "loss", loss)
                write(out, mode, way, "x.grad", x.grad)
                for name, p in model.named_parameters():
                    write(out, mode, way, name + ".grad", p.grad)
                for name, b in model.named_buffers():
                    write(out, mode, way, name, b)


def misuse_outcome(model, block, x0, change, undo):
    """Runs block(x) plain, then checkpointed with change() between forward and backward."""
    def gradients(x):
        grads = [x.grad] + [p.grad for p in model.parameters()]
        model.zero_grad()
        return [g.detach().clone() for g in grads if g is not None]

    x = x0.clone().requires_grad_()
    torch.manual_seed(32)
    block(x).pow(2).sum().backward()
    expected = gradients(x)
    x = x0.clone().requires_grad_()
    torch.manual_seed(32)
    y = checkpoint(block, x, use_reentrant=False)
    change()
    try:
        y.pow(2).sum().backward()
    except torch.utils.checkpoint.CheckpointError:
        return "CheckpointError", float("nan")
    except Exception as e:  # noqa: BLE001: any other failure is an outcome too
        return type(e).__name__, float("nan")
    finally:
        undo()
    got = gradients(x)
    if len(got) != len(expected):
        return "gradient", float("inf")
    return "gradient", max((a - b).abs().max().item() for a, b in zip(got, expected))


def misuses(output_path):
    torch.set_num_threads(1)
    torch.manual_seed(30)
    seq = torch.randn(2, 5, 16)
    images = torch.randn(4, 3, 6, 6)
    rows = torch.randn(4, 16)
    encoder = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU())
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    frozen = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                 torch.nn.ReLU()).eval()
    linear = torch.nn.Linear(16, 16)
    scale = [3.0]
    mask = torch.full((16,), 3.0)

    def set_scale(v):
        return lambda: scale.__setitem__(0, v)

    def step(v):
        def apply():
            with torch.no_grad():
                mlp[0].weight.add_(v)
        return apply

    cases = [
        ("encoder_eval", encoder, encoder, seq, encoder.eval, encoder.train),
        ("conv_bn_eval", conv, conv, images, conv.eval, conv.train),
        ("conv_bn_train", frozen, frozen, images, frozen.train, frozen.eval),
        ("mlp_eval", mlp, mlp, rows, mlp.eval, mlp.train),
        ("scalar_after", linear, lambda x: linear(x) * scale[0], rows, set_scale(8.0), set_scale(3.0)),
        ("scalar_before", linear, lambda x: torch.nn.functional.gelu(linear(x) * scale[0]), rows,
         set_scale(8.0), set_scale(3.0)),
        ("captured_tensor", linear, lambda x: linear(x) * mask, rows, lambda: mask.fill_(8.0),
         lambda: mask.fill_(3.0)),
        ("parameter_step", mlp, mlp, rows, step(0.5), step(-0.5)),
    ]
    with open(output_path, "w") as out:
        for name, model, block, x0, change, undo in cases:
            outcome, diff = misuse_outcome(model, block, x0, change, undo)
            out.write(f"misuse {name} {outcome} {diff!r}\n")


if __name__ == "__main__":
    if sys.argv[3:4] == ["misuse"]:
        misuses(sys.argv[2])
    else:
        main(*sys.argv[1:4])
