"""Sampling one token per row from the logits: temperature, top-p (through a top-k when it suffices), greedy.

Each step's sampling reads and writes [rows, vocabulary] float32 tensors, a pass per operation; at a 150k
vocabulary and hundreds of rows these passes are a good share of a GPU step. So the draw makes as few of them as
the samples allow: ``torch.multinomial``'s own draw (an Exp(1) variate per entry, the argmax of p / q) without its
checks of the whole tensor (two more passes and two host synchronisations a step), the operations in place,
and no division at T = 1. The samples are those ``torch.multinomial`` draws, bit for bit, for the same generator.
Finished rows still in the batch are sampled too: drawing for the running rows alone would hand each row other
variates (the draw covers the whole [rows, vocabulary] tensor) and so change every seeded run's samples, for rows
that are about a quarter of the batch at most (``schedule.SHED_FRACTION``) before a rebuild sheds them.

``fused=True`` (``Engine(fused_sampling=True)``) compiles the passes over the vocabulary with ``torch.compile``
instead, and no [rows, vocabulary] float32 copy of the logits is made: at top-p 1 the division by T, logsumexp and
the draw are one or two kernels over the logits and the Exp(1) variates; at top-p < 1 logsumexp is one, and the
top-k window is read off the logits themselves. Its draw is the same race (the argmax of x - log q, q ~
Exp(1) from the generator) in another order of rounding, so it draws from the same distribution but not always
the same tokens as the eager step; the same seed on the same device gives the same samples. The first call
compiles (seconds; a new temperature compiles again; on a CPU, torch.compile needs a C++ compiler).

Entropies (``SamplingParams(entropy=True)``): each row's entropy of softmax(logits / T), the distribution before
top-p (greedy: softmax(logits)), from the scaled logits and logsumexp the step already has: one more pass over
[rows, vocabulary] (log-probs, exp, -p log p summed), no random number drawn, no token changed; none when not asked.
"""

from __future__ import annotations

import functools

import torch

from vineppo.engine.api import SamplingParams

TOP_K = 32  # top-p sampling first tries the TOP_K most likely tokens (exact when they hold top_p of the mass)
WIDEN = 8  # else it widens the window by this factor until the window holds top_p (a full sort is the last resort)

Drawn = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # what ``sample`` returns: per row, the token, its
# log-prob and (when asked) the entropy of the distribution it was drawn from


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           fused: bool = False) -> Drawn:
    """Sample one token per row; return (tokens [N], log-probs [N] before top-p, entropies [N] or None), float32.

    The entropies (``params.entropy``) are those of softmax(logits / T) (greedy: softmax(logits)), from the step's
    own scaled logits and logsumexp: one more pass over [N, V], no random number, no change to any token."""
    T = params.temperature
    if T <= 0:
        lp_all = torch.log_softmax(logits.float(), dim=-1)
        tok = lp_all.argmax(dim=-1)
        return tok, lp_all.gather(1, tok.view(-1, 1)).view(-1), _entropy(lp_all) if params.entropy else None
    if fused:
        return _sample_fused(logits, params, generator)
    x = logits.float() / T if T != 1 else logits.float()  # x / 1 is x: no pass
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # log-probs are x - lse: no [N, V] log-softmax is kept
    check_finite(lse)
    ent = _entropy(torch.sub(x, lse)) if params.entropy else None
    if params.top_p < 1.0:
        tok = _draw_top_p(x, 1.0, lse, params.top_p, generator)
    else:
        tok = draw(torch.sub(x, lse).exp_(), generator)
    return tok, (x.gather(1, tok.view(-1, 1)) - lse).view(-1), ent


def _sample_fused(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Drawn:
    """``sample`` with the passes over the vocabulary compiled; no float32 copy of the logits is written (but for
    the entropies, when asked)."""
    T = float(params.temperature)
    if params.top_p >= 1.0:
        q = torch.empty(logits.shape, device=generator.device if generator is not None else logits.device)
        tok, lp, lse = _compiled(_race)(logits, q.exponential_(generator=generator).to(logits.device), T)
        check_finite(lse)
    else:
        lse = _compiled(_logsumexp)(logits, T)
        check_finite(lse)
        tok = _draw_top_p(logits, T, lse, params.top_p, generator)  # the window is read off the logits themselves
        lp = (logits.gather(1, tok.view(-1, 1)).float() / T - lse).view(-1)
    return tok, lp, _entropy(logits.float() / T - lse) if params.entropy else None


def _entropy(lp: torch.Tensor) -> torch.Tensor:
    """Per row, the entropy in nats of the distribution whose log-probs are ``lp`` [N, V]: -sum p log p, every term
    >= 0 (no cancellation however peaked the row), 0 log 0 = 0 (a token of logit -inf: NaN, which nansum drops)."""
    return -torch.nansum(lp.exp().mul_(lp), dim=-1)


def _draw_top_p(scores: torch.Tensor, T: float, lse: torch.Tensor, top_p: float, generator: torch.Generator | None):
    """One token per row from the nucleus of softmax(scores / T) (``lse``: its logsumexp per row)."""
    top_lp, top_idx = _nucleus_window(scores, T, lse, top_p)
    probs = top_lp.exp()
    cum = probs.cumsum(-1)
    # keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass is already >= top_p
    probs = probs.masked_fill((cum - probs) >= top_p, 0.0)
    return top_idx.gather(1, draw(probs, generator).view(-1, 1)).view(-1)


def _logsumexp(logits: torch.Tensor, T: float) -> torch.Tensor:
    """logsumexp(logits / T) per row in float32 (compiled: logits / T is never written out)."""
    return torch.logsumexp(logits.float() / T, dim=-1, keepdim=True)


def _race(logits: torch.Tensor, q: torch.Tensor, T: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exponential race on x = logits / T: argmax(x - log q) is drawn with probability softmax(x); its log-prob
    and the rows' logsumexp. Compiled, x is never written out."""
    x = logits.float() / T
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    tok = (x - q.log()).argmax(dim=-1)
    return tok, (x.gather(1, tok.view(-1, 1)) - lse).view(-1), lse


@functools.cache
def _compiled(fn):
    """``fn`` under torch.compile, for any number of rows (compiled on its first call)."""
    return torch.compile(fn, dynamic=True)


def _nucleus_window(scores: torch.Tensor, T: float, lse: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of every row (log-probs, ids, sorted), for the smallest k tried that holds top_p.

    At T < 1 the nucleus is usually inside the top TOP_K; a flat row (an instruct model on an unfamiliar
    prompt, say) needs more. Widening by WIDEN costs a few top-k passes, where a sort of a 50k vocabulary and a
    draw from all of it cost ten times more per step; draws stay exact, as the window always holds the nucleus.
    """
    V = scores.shape[-1]
    k = min(TOP_K, V)
    while True:
        top_x, top_idx = scores.topk(k, dim=-1)
        top_lp = top_x.float() / T - lse  # [N, k] only; the eager step passes x, already divided, and T = 1
        if k == V or bool((top_lp.exp().sum(-1) >= top_p).all()):
            return top_lp, top_idx
        k = min(V, k * WIDEN)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from unnormalised probabilities, as ``torch.multinomial(probs, 1)`` draws it: the argmax
    of p / q, q ~ Exp(1) from ``generator`` (on its device: the probabilities move there and the draw back).

    ``probs`` is overwritten. multinomial first checks the whole tensor (its max, min and row sums, each read
    back by the host); ``check_finite`` on the [N, 1] normaliser covers what those checks catch here."""
    if generator is not None and generator.device != probs.device:
        return draw(probs.to(generator.device), generator).to(probs.device)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


def check_finite(lse: torch.Tensor) -> None:
    """Stop with one line when a row's logits hold NaN or inf (lse is then not finite): a diverged model."""
    bad = ~torch.isfinite(lse.view(-1))
    if bool(bad.any()):
        raise FloatingPointError(f"sampling: the model's next-token logits are NaN or infinite in {int(bad.sum())} "
                                 f"of {bad.numel()} rows (a diverged model, or NaN weights); nothing to sample from")
