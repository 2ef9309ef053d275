"""The main job's 3-seed table and overlay plot from the files in this folder (see commands.txt).

python results/main-job/table.py   # prints the Markdown table, writes seeds.png
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
SEEDS = (0, 1, 2)


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text())


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def row(seed: int) -> str:
    sft, fin, rl = load(f"sft-s{seed}-eval.json"), load(f"final-s{seed}-eval.json"), load(f"rl-s{seed}-summary.json")
    sft_s = load(f"sft-s{seed}-config.json")["time_s"]
    cells = [seed, pct(sft["pass@1"]), pct(sft["greedy"]), pct(sft["behaviours"]["premature"]["share"]),
             pct(sft["behaviours"]["careful"]["pass@1"]), pct(fin["pass@1"]), pct(fin["greedy"]), pct(fin["maj@k"]),
             pct(fin["behaviours"]["premature"]["share"]), f"{100 * (fin['pass@1'] - sft['pass@1']):+.1f}",
             f"{sft_s:.0f}", f"{rl['wall_clock_s']:.0f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def plot() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for seed in SEEDS:
        rows = [json.loads(line) for line in (HERE / f"rl-s{seed}-metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "test/pass@1" in r]
        its = [r["iteration"] for r in evals]
        axes[0].plot(its, [r["test/pass@1"] for r in evals], marker="o", label=f"SFT seed {seed}")
        axes[1].plot(its, [r.get("test/behaviour/premature", float("nan")) for r in evals], marker="o",
                     label=f"SFT seed {seed}")
    axes[0].set(xlabel="iteration", ylabel="test pass@1 (200 problems x 4)", title="accuracy")
    axes[1].set(xlabel="iteration", ylabel="share of test samples", title="premature answers")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "seeds.png", dpi=110)


if __name__ == "__main__":
    print("| SFT seed | SFT pass@1 | SFT greedy | SFT premature share | SFT careful samples right | final pass@1 | "
          "final greedy | final maj@16 | final premature share | gain (points) | SFT s | RL s |")
    print("|" + "---|" * 12)
    for s in SEEDS:
        print(row(s))
    plot()
