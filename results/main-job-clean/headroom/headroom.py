"""pass@1, greedy, maj@16 and pass@16 from `vineppo eval --samples 16` per-problem files (the JSONL it writes),
and the share of responses marked correct that hold a wrong line (`first_error_step`), for files written before
`eval --json` reported pass@k and maj@k itself.

    python results/main-job/headroom/headroom.py EVAL.jsonl [...] [--json]
"""
import json
import sys
import types

from vineppo.tasks import get_task
from vineppo.training.evaluation import first_error_step, majority_vote

ARITH = get_task("arith")
PROBLEMS = {ex.id: ex for ex in ARITH.load("test", None, 0)}


def headroom(path: str) -> dict:
    """The scores of one per-problem file, averaged over its problems."""
    rows = [json.loads(line) for line in open(path)]
    right = lucky = 0
    for r in rows:
        for text, ok in zip(r["sample_texts"], r["sample_correct"]):
            if ok:
                right += 1
                lucky += first_error_step(PROBLEMS[r["id"]], text) is not None
    n = len(rows)
    maj = [majority_vote(ARITH, [types.SimpleNamespace(text=t) for t in r["sample_texts"]], r["sample_correct"])
           for r in rows]
    return {"file": path, "problems": n, "pass@1": sum(r["pass@1"] for r in rows) / n,
            "greedy": sum(r["greedy"] for r in rows) / n, "maj@k": sum(maj) / n,
            "pass@k": sum(r["correct"] > 0 for r in rows) / n, "correct_with_a_wrong_line": lucky / max(right, 1)}


if __name__ == "__main__":
    out = [headroom(p) for p in sys.argv[1:] if p != "--json"]
    for h in out:
        print(json.dumps(h) if "--json" in sys.argv else
              f"{h['file']}: pass@1 {h['pass@1']:.3f} greedy {h['greedy']:.3f} maj@k {h['maj@k']:.3f} "
              f"pass@k {h['pass@k']:.3f} correct-with-a-wrong-line {h['correct_with_a_wrong_line']:.3f}")
