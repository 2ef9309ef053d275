"""Per-step error rate by step position (results/long-chain/README.md): python step_errors.py EVAL.jsonl [ARITH_DATA|-]; first errors at line i / responses with lines 0..i-1 right that had a line i."""
import json
import sys

from vineppo.tasks import get_task
from vineppo.training.evaluation import first_error_step

jsonl, data = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None)
exs = {e.id: e for e in get_task("arith").load("test", data, 0)}
reach, err = {}, {}
n_resp = 0
for line in open(jsonl):
    row = json.loads(line); ex = exs[row["id"]]
    n_steps = len([l for l in ex.solution.split("\n") if l and not l.startswith("####")])
    for text, ok in zip(row["sample_texts"], row["sample_correct"]):
        n_resp += 1
        fe = None if ok else first_error_step(ex, text)
        stop = n_steps if fe is None else min(fe[0] + 1, n_steps)
        for i in range(stop):
            reach[i] = reach.get(i, 0) + 1
        if fe is not None and fe[0] < n_steps:
            err[fe[0]] = err.get(fe[0], 0) + 1
rates = {i: err.get(i, 0) / reach[i] for i in sorted(reach)}
tot = sum(err.values()) / sum(reach.values())
print(json.dumps({"responses": n_resp, "per_step_error": round(tot, 4),
                  "by_position": {i: [round(r, 4), reach[i]] for i, r in rates.items()}}))
