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


if __name__ == "__main__":
    main(*sys.argv[1:4])
