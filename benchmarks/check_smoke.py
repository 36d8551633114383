"""Checks a benchmark's Markdown output (stdin) for ctest's smoke runs: at least one table with a
ratio column, every figure finite, and every time and ratio positive. A table of NaN fails.

    ./bench_x --smoke | python3 check_smoke.py
"""
import math
import re
import sys

NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*(x|×|%|ms|us|µs|s|GB/s|MB|MiB|GiB)?$")
NOT_FINITE = re.compile(r"^[-+]?(nan|inf|infinity)\s*(x|×|%|ms|s)?$", re.IGNORECASE)
POSITIVE = re.compile(r"ratio|\bms\b|\bs\b|time|per step|/s|speed", re.IGNORECASE)


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def main():
    lines = sys.stdin.read().splitlines()
    problems, ratio_columns, rows = [], 0, 0
    i = 0
    while i < len(lines):
        if i + 1 < len(lines) and lines[i].startswith("|") and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
            header = cells(lines[i])
            ratio_columns += sum("ratio" in h.lower() for h in header)
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows += 1
                for name, cell in zip(header, cells(lines[i])):
                    if NOT_FINITE.match(cell):
                        problems.append(f"{name} = {cell!r} in: {lines[i]}")
                        continue
                    m = NUMBER.match(cell.replace(",", ""))
                    if m and POSITIVE.search(name) and not float(m.group(1)) > 0:
                        problems.append(f"{name} = {cell!r} is not positive in: {lines[i]}")
                i += 1
        else:
            i += 1
    if ratio_columns == 0 or rows == 0:
        problems.append(f"no table with a ratio column ({rows} table rows)")
    for p in problems:
        print("check_smoke:", p, file=sys.stderr)
    if not problems:
        print(f"check_smoke: {rows} rows, {ratio_columns} ratio columns, all figures finite and positive",
              file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
