"""Sampling one token per row from the logits: temperature, top-p (through a top-k when it suffices), greedy."""

from __future__ import annotations

import torch

from vineppo.engine.api import SamplingParams

TOP_K = 32  # top-p sampling first tries the TOP_K most likely tokens (exact when they hold top_p of the mass)
WIDEN = 8  # else it widens the window by this factor until the window holds top_p (a full sort is the last resort)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Sample one token per row; return (tokens [N], log-probs [N] before top-p, float32)."""
    logits = logits.float()
    T = params.temperature
    if T <= 0:
        lp_all = torch.log_softmax(logits, dim=-1)
        tok = lp_all.argmax(dim=-1)
        return tok, lp_all.gather(1, tok.view(-1, 1)).view(-1)
    x = logits / T
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # log-probs are x - lse: no [N, V] log-softmax is kept
    if params.top_p < 1.0:
        top_lp, top_idx = _nucleus_window(x, lse, params.top_p)
        probs = top_lp.exp()
        cum = probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass is already >= top_p
        probs = probs.masked_fill((cum - probs) >= params.top_p, 0.0)
        choice = multinomial(probs, generator)
        tok = top_idx.gather(1, choice.view(-1, 1)).view(-1)
    else:
        tok = multinomial((x - lse).exp(), generator)
    return tok, (x.gather(1, tok.view(-1, 1)) - lse).view(-1)


def _nucleus_window(x: torch.Tensor, lse: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of every row (log-probs, ids, sorted), for the smallest k tried that holds top_p.

    At T < 1 the nucleus is usually inside the top TOP_K; a flat row (an instruct model on an unfamiliar
    prompt, say) needs more. Widening by WIDEN costs a few top-k passes, where a sort of a 50k vocabulary and a
    draw from all of it cost ten times more per step; draws stay exact, as the window always holds the nucleus.
    """
    V = x.shape[-1]
    k = min(TOP_K, V)
    while True:
        top_x, top_idx = x.topk(k, dim=-1)
        top_lp = top_x - lse
        if k == V or bool((top_lp.exp().sum(-1) >= top_p).all()):
            return top_lp, top_idx
        k = min(V, k * WIDEN)


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row; on the generator's device when it differs from the probabilities' (then moved back)."""
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).view(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
