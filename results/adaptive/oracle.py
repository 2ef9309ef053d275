"""How cheap can K = 9's value error get on these states? Exact expectations, no sampling.

    python results/adaptive/oracle.py [results/values/values.json ...] [--json]

For every state of an `analyze-values` run, take its 256-rollout value p as the truth. Then, exactly (binomial
sums, not simulation):
- fixed K: the expected MAE of the mean of K continuations;
- `agree` k/K (the library's rule): k continuations; if all agree the state takes 0 or 1, else it gets K in all;
- `agree` k/K + own: the same, counting the response's own outcome from that state as the first of the k
  (it is a sample of the same policy from the same prefix, so it costs nothing; the library does not do this,
  see results/adaptive/NOTES.md for why: in training it correlates a step's baseline with the step's own action);
- an allocation oracle that knows every p and gives each state a fixed number n of continuations (any n from
  1 to 64, the mean as the estimate): the least continuations for which its expected MAE is at most fixed
  K = 9's, as a Lagrangian lower bound (no allocation of fixed counts, randomised or not, does better). Costs
  are counted in continuations and in step-weighted tokens (a continuation from step t of an s-step
  response costs s - t steps' tokens).
Everything is a fraction of fixed K = 9's cost; the MAE of a setting over K = 9's is `error_ratio`.
"""
import argparse
import json
from functools import lru_cache
from math import comb

N_MAX = 64


@lru_cache(maxsize=None)
def _pmf(n: int, p: float) -> tuple[float, ...]:
    return tuple(comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(n + 1))


@lru_cache(maxsize=None)
def fixed_err(n: int, p: float) -> float:
    """E|mean of n Bernoulli(p) - p|."""
    return sum(w * abs(j / n - p) for j, w in enumerate(_pmf(n, p)))


def agree(k: int, K: int, p: float, own: bool) -> tuple[float, float]:
    """(expected |error|, expected continuations drawn) of `agree` k/K; with `own`, one of the k is free."""
    drawn_first, drawn_all = (k - 1, K - 1) if own else (k, K)
    pk = _pmf(k, p)
    err = pk[0] * p + pk[k] * (1 - p)
    rest = _pmf(K - k, p)
    for j in range(1, k):
        err += pk[j] * sum(w * abs((j + m) / K - p) for m, w in enumerate(rest))
    stop = pk[0] + pk[k]
    return err, stop * drawn_first + (1 - stop) * drawn_all


def oracle_cost(ps: list[float], costs: list[float], target: float) -> float:
    """Lower bound on sum_s cost_s * n_s over allocations with mean expected error <= target (Lagrangian dual)."""
    best = 0.0
    for i in range(1, 400):
        lam = 10 ** (-7 + 7 * i / 400)  # error units per unit cost
        g = sum(min(fixed_err(n, p) + lam * c * n for n in range(1, N_MAX + 1)) for p, c in zip(ps, costs))
        best = max(best, (g - target * len(ps)) / lam)
    return best


def analyse(path: str) -> dict:
    """Every setting's expected MAE and cost against fixed K = 9 on the states of one values.json."""
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    ps = [round(r["true"], 6) for r in rows]
    w = [r["steps"] - r["t"] for r in rows]
    n9 = 9 * len(ps)
    base = sum(fixed_err(9, p) for p in ps) / len(ps)
    out = {"values": path, "states": len(ps), "uncertain_states": sum(0 < p < 1 for p in ps),
           "k9_expected_mae": base, "k9_measured_mae": data["mae"]["vineppo_k9"], "settings": []}
    for K in (1, 3, 9):
        e = sum(fixed_err(K, p) for p in ps) / len(ps)
        out["settings"].append({"setting": f"fixed K={K}", "mae": e, "error_ratio": e / base, "continuations": K / 9,
                                "tokens": K / 9})
    for k, K in ((2, 9), (3, 9), (4, 9), (4, 12)):
        for own in (False, True):
            res = [agree(k, K, p, own) for p in ps]
            e = sum(r[0] for r in res) / len(ps)
            out["settings"].append({
                "setting": f"agree {k}/{K}" + (" + own" if own else ""), "mae": e, "error_ratio": e / base,
                "continuations": sum(r[1] for r in res) / n9,
                "tokens": sum(r[1] * wi for r, wi in zip(res, w)) / (9 * sum(w))})
    out["oracle"] = {"continuations": oracle_cost(ps, [1.0] * len(ps), base) / n9,
                     "tokens": oracle_cost(ps, [float(x) for x in w], base) / (9 * sum(w))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("values", nargs="*", default=["results/values/values.json"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    for path in a.values:
        r = analyse(path)
        if a.json:
            print(json.dumps(r))
            continue
        print(f"{path}: {r['states']} states, {r['uncertain_states']} with 0 < p < 1; fixed K = 9 expected MAE "
              f"{r['k9_expected_mae']:.4f} (measured {r['k9_measured_mae']:.4f})")
        for s in r["settings"]:
            print(f"  {s['setting']:<16} MAE {s['mae']:.4f} ({s['error_ratio']:.2f}x K=9)  continuations "
                  f"{s['continuations']:.0%}  tokens {s['tokens']:.0%}")
        o = r["oracle"]
        print(f"  allocation oracle at K = 9's MAE: >= {o['continuations']:.0%} of the continuations, "
              f">= {o['tokens']:.0%} of the step-weighted tokens")


if __name__ == "__main__":
    main()
