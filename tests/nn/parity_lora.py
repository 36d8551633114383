"""PEFT's side of tests/nn/test_lora.cpp: the same model (fc1, fc2, head), base weights, adapter
initialisation and data, trained by PEFT; and PEFT's files both ways.

    python parity_lora.py INPUT DIR

INPUT is a torch::pickle_save dict from the C++ side: the base weights (param.NAME), the data
(x, y) and the settings (steps, batch, lr, weight_decay, rank, alpha, dropout, seed). For fp32
and bf16 (torch.autocast on the CPU), torch.manual_seed(seed) then get_peft_model(LoraConfig(r,
lora_alpha, target_modules=["fc1", "fc2"], lora_dropout, modules_to_save=["head"])), then
`steps` steps of AdamW written in LibTorch's arithmetic (DESIGN.md 11: torch.optim.AdamW's lerp
and ** 0.5 part from LibTorch's in the last bit): DIR/MODE_losses.txt (repr of each loss) and
DIR/MODE_weights.safetensors (the trained parameters by PEFT's names). Then:
- PeftModel.from_pretrained on DIR/mixprec_adapter (written by mixprec): its outputs on x in
  DIR/from_mixprec.safetensors;
- a PEFT adapter with non-zero B saved to DIR/peft_adapter, its outputs in
  DIR/peft_outputs.safetensors, for mixprec's load_lora_adapter;
- DIR/merged.safetensors (mixprec's save_merged_safetensors) loaded into the plain model: its
  outputs in DIR/merged_outputs.safetensors.
"""
import math
import os
import sys
import warnings

import torch
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def base(data):
    net = Net()
    net.load_state_dict({k[len("param."):]: v for k, v in data.items() if k.startswith("param.")})
    return net


def libtorch_adamw_step(params, state, lr, weight_decay, step, beta1=0.9, beta2=0.999, eps=1e-8):
    # torch/csrc/api/src/optim/adamw.cpp, op for op.
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            s = state.setdefault(p, {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            s["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            s["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (s["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(eps)
            p.addcdiv_(s["exp_avg"], denom, value=-(lr / bias_correction1))


def config(data, dropout):
    return LoraConfig(r=int(data["rank"]), lora_alpha=float(data["alpha"]),
                      target_modules=["fc1", "fc2"], lora_dropout=dropout,
                      modules_to_save=["head"])


def train(mode, data, directory):
    net = base(data)  # before the seed: its construction draws values of its own
    torch.manual_seed(int(data["seed"]))
    model = get_peft_model(net, config(data, float(data["dropout"])))
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = data["x"], data["y"]
    steps, batch = int(data["steps"]), int(data["batch"])
    state = {}
    losses = []
    torch.manual_seed(int(data["seed"]) + 1)  # the dropout masks'
    for step in range(steps):
        xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        libtorch_adamw_step(params, state, float(data["lr"]), float(data["weight_decay"]), step + 1)
        losses.append(loss.item())
    with open(os.path.join(directory, mode + "_losses.txt"), "w") as out:
        out.write("\n".join(repr(v) for v in losses) + "\n")
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad},
              os.path.join(directory, mode + "_weights.safetensors"))


def main(input_path, directory):
    torch.set_num_threads(1)
    data = torch.load(input_path, weights_only=False)  # torch::pickle_save from the C++ test
    for mode in ("fp32", "bf16"):
        train(mode, data, directory)
    x = data["x"]
    loaded = PeftModel.from_pretrained(base(data), os.path.join(directory, "mixprec_adapter")).eval()
    with torch.no_grad():
        save_file({"out": loaded(x)}, os.path.join(directory, "from_mixprec.safetensors"))
    torch.manual_seed(5)
    peft = get_peft_model(base(data), config(data, 0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    peft.save_pretrained(os.path.join(directory, "peft_adapter"))
    with torch.no_grad():
        save_file({"out": peft.eval()(x)}, os.path.join(directory, "peft_outputs.safetensors"))
    merged = Net()
    merged.load_state_dict(load_file(os.path.join(directory, "merged.safetensors")))
    with torch.no_grad():
        save_file({"out": merged(x)}, os.path.join(directory, "merged_outputs.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
