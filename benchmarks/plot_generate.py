"""Plot `bench_generate.py`'s JSON: ms per decode step against batch size, one panel per model
shape, one line per implementation, the weight-read floor drawn.

    python benchmarks/plot_generate.py benchmarks/results/generate.json --png benchmarks/generate.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--png", required=True)
    args = p.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    shapes = list(result["weight_read_floor_ms"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"] if "ms_per_step" in r))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}  # one colour per impl in every panel
    for ax, shape in zip(axes[0], shapes):
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in result["rows"]:
            if r["shape"] == shape and "ms_per_step" in r:
                lines[r["impl"]].append((r["batch"], r["ms_per_step"]))
        for impl, points in lines.items():
            points.sort()
            ax.plot([b for b, _ in points], [ms for _, ms in points], marker="o", label=impl, color=colors[impl])
        ax.axhline(result["weight_read_floor_ms"][shape], color="black", linestyle="--", label="weight-read floor")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{shape} shape, bf16, {result['device']}")
        ax.legend(fontsize=8)
    fig.suptitle(result["command"], fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
