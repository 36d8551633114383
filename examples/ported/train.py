"""A Python AMP training script, as a PyTorch user writes one; train.cpp beside it is its C++ port.

An MLP with dropout classifies synthetic data: torch.autocast("cpu", float16) with
GradScaler("cpu"), AdamW, gradient clipping, StepLR, two micro-batches per optimizer step, an
evaluation every 10 steps, a checkpoint to stop and resume from, and the fp32 weights at the end.

    python train.py --init init.pt --steps 60 --log steps.csv --eval eval.csv
                    [--stop-after 30 --checkpoint run.pt] [--resume run.pt] [--export final.pt]
                    [--precision bf16] [--check-export cpp_final.pt]

--init: the initial weights, which train.cpp wrote (trainer.save_fp32(path, WeightsFormat::pickle)),
so that both start from the same model. --precision bf16: bfloat16 autocast, no loss scaling
(torch 1.13 has no CPU GradScaler). --check-export: load train.cpp's fp32 export into a model of
this script and print how far its weights are from this run's.
"""
import argparse
import csv
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = self.drop(F.relu(self.fc1(x)))
        x = self.drop(F.relu(self.fc2(x)))
        return self.head(x)


def make_data():
    """512 points in 20 dimensions, 4 classes from a noisy linear map; the last 64 for testing."""
    torch.manual_seed(1234)
    x = torch.randn(512, 20)
    y = (x @ torch.randn(20, 4) + 0.5 * torch.randn(512, 4)).argmax(1)
    return x[:448], y[:448], x[448:], y[448:]


def evaluate(model, x, y, dtype):
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        logits = model(x)
    model.train()
    loss = F.cross_entropy(logits.float(), y).item()
    accuracy = (logits.argmax(1) == y).float().mean().item()
    return loss, accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--resume", default="")
    parser.add_argument("--export", default="")
    parser.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--check-export", default="")
    args = parser.parse_args()
    batch, accumulation, eval_every = 32, 2, 10
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16

    model = Net()
    model.load_state_dict(dict(torch.load(args.init)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    if args.precision == "fp16":
        # A large first scale and a short growth interval, so that this short run sees the scale
        # back off on overflow and grow again.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=10)
    elif hasattr(torch.amp, "GradScaler"):
        scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16 needs no scaling: a no-op
    else:
        scaler = torch.cuda.amp.GradScaler(enabled=False)  # torch 1.13 has no torch.amp's
    x_train, y_train, x_test, y_test = make_data()

    start = 0
    if args.resume:
        state = torch.load(args.resume, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    else:
        torch.manual_seed(1)  # the dropout masks

    mode = "a" if args.resume else "w"
    with open(args.log, mode, newline="") as log_file, open(args.eval, mode, newline="") as eval_file:
        log, evals = csv.writer(log_file), csv.writer(eval_file)
        if not args.resume:
            log.writerow(["step", "loss", "lr", "scale", "skipped", "grad_norm", "samples_per_s"])
            evals.writerow(["step", "loss", "accuracy"])
        since = time.perf_counter()
        for step in range(start, args.steps):
            losses = []
            for micro in range(accumulation):
                i = (step * accumulation + micro) * batch % x_train.shape[0]
                xb, yb = x_train[i:i + batch], y_train[i:i + batch]
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.cross_entropy(model(xb), yb)
                scaler.scale(loss / accumulation).backward()
                losses.append(loss.item())
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
            lr, scale = optimizer.param_groups[0]["lr"], scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < scale
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            now = time.perf_counter()
            rate = accumulation * batch / (now - since)
            since = now
            log.writerow([step + 1, repr(sum(losses) / len(losses)), repr(lr), repr(scale),
                          int(skipped), repr(grad_norm), f"{rate:.1f}"])
            if (step + 1) % eval_every == 0:
                loss, accuracy = evaluate(model, x_test, y_test, dtype)
                evals.writerow([step + 1, repr(loss), repr(accuracy)])
                print(f"step {step + 1}  eval loss {loss:.4f}  accuracy {100 * accuracy:.1f}%")
            if step + 1 == args.stop_after:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                            "rng": torch.get_rng_state(), "step": step + 1}, args.checkpoint)
                print(f"stopped after step {step + 1}: {args.checkpoint}")
                return

    if args.export:
        torch.save(model.state_dict(), args.export)
    if args.check_export:
        theirs = Net()
        theirs.load_state_dict(dict(torch.load(args.check_export)))
        largest = max((a - b).abs().max().item()
                      for a, b in zip(model.state_dict().values(), theirs.state_dict().values()))
        _, accuracy = evaluate(theirs, x_test, y_test, dtype)
        print(f"export {os.path.basename(args.check_export)}: largest weight difference "
              f"{largest!r}, accuracy {accuracy!r}")


if __name__ == "__main__":
    main()
