#!/usr/bin/env python3
"""Plots the demo's loss curves: python3 plot.py LOSS.csv OUTPUT (writes OUTPUT.svg, OUTPUT.png).

LOSS.csv is what `fashion_mnist --csv` writes: one row per optimizer step of each run (run,
dtype, images, step, loss, scale). One row of panels per low precision (each on its own step
axis: the fp16 runs train on fewer images): the smoothed training loss, its difference to the
same group's FullPrecision run (same initial weights and data order, so the difference is the
policy's), and, where a run scales its loss, the loss scale with the skipped steps marked.
"""
import csv
import math
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    runs = OrderedDict()  # (dtype, run) -> {"images", "loss", "scale"}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (row["dtype"], row["run"])
            r = runs.setdefault(key, {"images": int(row["images"]), "loss": [], "scale": []})
            r["loss"].append(float(row["loss"]))
            r["scale"].append(float(row["scale"]))
    if not runs:
        sys.exit(f"plot.py: {path} has no rows")
    return runs


def smooth(values, weight):
    out, avg = [], None
    for v in values:
        if math.isfinite(v):
            avg = v if avg is None else weight * avg + (1 - weight) * v
        out.append(avg if avg is not None else math.nan)
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot.py LOSS.csv OUTPUT  (writes OUTPUT.svg and OUTPUT.png)")
    runs = read(sys.argv[1])
    groups = OrderedDict()
    for (dtype, name), r in runs.items():
        groups.setdefault(dtype, OrderedDict())[name] = r
    scaled = any(s != 1.0 for r in runs.values() for s in r["scale"])
    columns = 3 if scaled else 2
    fig, axes = plt.subplots(len(groups), columns, figsize=(5.2 * columns + 2.6, 3.6 * len(groups)),
                             squeeze=False)
    for row, (dtype, members) in enumerate(groups.items()):
        steps = max(len(r["loss"]) for r in members.values())
        weight = min(0.98, max(0.6, 1 - 20 / max(steps, 1)))
        reference = next((r for n, r in members.items() if n.startswith("FullPrecision")), None)
        ref = smooth(reference["loss"], weight) if reference else None
        images = next(iter(members.values()))["images"]
        loss_ax, diff_ax = axes[row][0], axes[row][1]
        for name, r in members.items():
            x = range(1, len(r["loss"]) + 1)
            y = smooth(r["loss"], weight)
            (line,) = loss_ax.plot(x, y, label=name, linewidth=1.1)
            if ref and name != next(iter(members)) and len(ref) == len(y):
                diff_ax.plot(x, [a - b for a, b in zip(y, ref)], color=line.get_color(),
                             linewidth=1.1)
            if scaled and any(s != 1.0 for s in r["scale"]):
                ax = axes[row][2]
                ax.plot(x, r["scale"], color=line.get_color(), linewidth=1.1, drawstyle="steps-post")
                skipped = [i + 1 for i, v in enumerate(r["loss"]) if not math.isfinite(v)]
                # A skip shows where the scale halves; mark every step whose scale fell.
                falls = [i + 1 for i in range(1, len(r["scale"])) if r["scale"][i] < r["scale"][i - 1]]
                marks = sorted(set(skipped + [f - 1 for f in falls]))
                ax.plot(marks, [r["scale"][m - 1] for m in marks], "x", color=line.get_color(),
                        markersize=5)
        title = f"{dtype}: {images} training images"
        loss_ax.set_title(f"{title}\ntraining loss (moving average, weight {weight:.2f})", fontsize=9)
        loss_ax.set_xlabel("optimizer step")
        loss_ax.set_ylabel("cross-entropy")
        diff_ax.set_title(f"{dtype}: smoothed loss minus FullPrecision's\n(same weights and data: "
                          "the difference is the policy's)", fontsize=9)
        diff_ax.axhline(0, color="gray", linewidth=0.6)
        diff_ax.set_xlabel("optimizer step")
        if scaled:
            ax = axes[row][2]
            if ax.lines:
                ax.set_yscale("log", base=2)
                ax.set_title(f"{dtype}: loss scale (x: a step skipped for inf/NaN,\nthe scale "
                             "halved; it doubles after 250 clean steps)", fontsize=9)
                ax.set_xlabel("optimizer step")
            else:
                ax.set_title(f"{dtype}: no loss scaling (scale 1)", fontsize=9)
                ax.set_axis_off()
        # The legend right of the row's last panel, outside every curve.
        handles, labels = loss_ax.get_legend_handles_labels()
        axes[row][-1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.04, 1.0),
                             fontsize=8, frameon=False, title=dtype)
    fig.suptitle("Fashion-MNIST: the same CNN under each precision policy", fontsize=11)
    fig.tight_layout()
    for extension in ("svg", "png"):
        fig.savefig(f"{sys.argv[2]}.{extension}", dpi=110, bbox_inches="tight")
    print(f"plot.py: wrote {sys.argv[2]}.svg and {sys.argv[2]}.png")


if __name__ == "__main__":
    main()
