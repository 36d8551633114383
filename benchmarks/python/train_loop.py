#!/usr/bin/python3
"""The Python side of benchmarks/bench_vs_python.cpp: the same training loops in PyTorch.

A long-lived child process driven over a pipe, one command per line on stdin, one reply per line
on stdout (anything else goes to stderr), so that interpreter start-up is not timed and both
sides are warm:

    setup NAME model=cnn|tagger precision=fp32|bf16 threads=T seed=S batch=B batches=K
          [vocab=V d=D heads=H seq=L classes=C]     -> "ok NAME <weights checksum> <data checksum>"
    run N            (with one loop set up)         -> "<ms>"  N training steps, timed in Python
    run NAME N                                      -> "<ms>"
    loss NAME                                       -> "<the last step's loss>"
    free NAME                                       -> "ok"
    quit

On start it prints "ready <torch version> <threads>". An error is replied as "error <message>".
It must run under Debian's /usr/bin/python3 (python3-torch), which uses the same LibTorch as the
C++ side. The models and data mirror benchmarks/models.hpp: the modules are created in the same
order, so that one seed gives the same initial weights and batches in both languages (the
checksums in the "ok" reply let the C++ side verify that).
"""

import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Cnn(nn.Module):
    """The Fashion-MNIST demo's CNN (examples/fashion_mnist/main.cpp)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Tagger(nn.Module):
    """One pre-norm transformer block with masked self-attention and a per-token classifier."""

    def __init__(self, vocab, d, heads, classes):
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(d // heads)
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, pad):
        b, s = tokens.shape
        h = self.emb(tokens)
        qkv = self.qkv(self.ln1(h)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        # pad: [b, 1, 1, s], True at padded keys
        weights = scores.masked_fill(pad, float("-inf")).softmax(-1)
        h = h + self.proj((weights @ v).transpose(1, 2).reshape(b, s, -1))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(h)


def image_batches(count, batch):
    out = []
    for _ in range(count):
        x = torch.randn(batch, 1, 28, 28)
        y = torch.randint(0, 10, (batch,))
        out.append((x, y))
    return out


def token_batches(count, batch, seq, vocab, classes):
    out = []
    for _ in range(count):
        lengths = torch.randint(seq // 2, seq + 1, (batch,))
        tokens = torch.randint(1, vocab, (batch, seq))
        labels = torch.randint(0, classes, (batch, seq))
        keep = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
        tokens = tokens.masked_fill(keep.logical_not(), 0)
        labels = labels.masked_fill(keep.logical_not(), -100)
        pad = keep.view(batch, 1, 1, seq).logical_not()
        out.append((tokens, labels, keep, pad))
    return out


def checksum(tensors):
    total = 0.0
    for t in tensors:
        total += t.detach().double().sum().item()
    return total


class Loop:
    def __init__(self, args):
        model = args["model"]
        precision = args["precision"]
        if precision not in ("fp32", "bf16"):
            raise ValueError("precision must be fp32 or bf16, got " + precision)
        seed = int(args["seed"])
        batch = int(args["batch"])
        count = int(args["batches"])
        torch.manual_seed(seed)
        if model == "cnn":
            self.model = Cnn()
            torch.manual_seed(seed + 1)
            self.batches = image_batches(count, batch)
            data = [t for b in self.batches for t in b]
            net = self.model

            def loss_of(b):
                return F.cross_entropy(net(b[0]), b[1])

        elif model == "tagger":
            classes = int(args["classes"])
            self.model = Tagger(int(args["vocab"]), int(args["d"]), int(args["heads"]), classes)
            torch.manual_seed(seed + 1)
            seq = int(args["seq"])
            self.batches = token_batches(count, batch, seq, int(args["vocab"]), classes)
            data = [t for b in self.batches for t in b[:3]]
            net = self.model

            def loss_of(b):
                return F.cross_entropy(net(b[0], b[3]).view(-1, classes), b[1].view(-1))

        else:
            raise ValueError("model must be cnn or tagger, got " + model)
        self.model.train()
        self.weights_checksum = checksum(self.model.parameters())
        self.data_checksum = checksum(data)
        opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        # Gradients are zeroed in place (set_to_none=False), as LibTorch 1.13 and the Trainer do.
        if precision == "fp32":

            def step(b):
                opt.zero_grad()
                loss = loss_of(b)
                loss.backward()
                opt.step()
                return loss

        else:

            def step(b):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_of(b)
                loss.backward()
                opt.step()
                return loss

        self.step = step
        self.cursor = 0
        self.last_loss = None

    def run(self, n):
        step = self.step
        batches = self.batches
        k = len(batches)
        i = self.cursor
        loss = None
        start = time.perf_counter()
        for _ in range(n):
            loss = step(batches[i % k])
            i += 1
        elapsed = time.perf_counter() - start
        self.cursor = i
        self.last_loss = loss
        return elapsed * 1e3


def parse(words):
    args = {}
    for w in words:
        key, sep, value = w.partition("=")
        if not sep:
            raise ValueError("expected key=value, got " + w)
        args[key] = value
    return args


def main():
    loops = {}
    out = sys.stdout

    def reply(text):
        out.write(text + "\n")
        out.flush()

    reply("ready %s %d" % (torch.__version__, torch.get_num_threads()))
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        words = line.split()
        if not words:
            continue
        try:
            command = words[0]
            if command == "quit":
                return
            if command == "setup":
                name = words[1]
                args = parse(words[2:])
                torch.set_num_threads(int(args["threads"]))
                loops.pop(name, None)
                loop = Loop(args)
                loops[name] = loop
                reply("ok %s %.17g %.17g" % (name, loop.weights_checksum, loop.data_checksum))
            elif command == "run":
                if len(words) == 2:
                    if len(loops) != 1:
                        raise ValueError("'run N' needs exactly one loop set up; use 'run NAME N'")
                    loop = next(iter(loops.values()))
                    n = int(words[1])
                else:
                    loop = loops[words[1]]
                    n = int(words[2])
                reply("%.6f" % loop.run(n))
            elif command == "loss":
                loss = loops[words[1]].last_loss
                reply("nan" if loss is None else "%.9g" % loss.item())
            elif command == "free":
                loops.pop(words[1], None)
                reply("ok")
            else:
                raise ValueError("unknown command " + command)
        except Exception as e:  # the C++ side reports it and stops
            reply("error %s: %s" % (type(e).__name__, str(e).replace("\n", " ")))


if __name__ == "__main__":
    main()
