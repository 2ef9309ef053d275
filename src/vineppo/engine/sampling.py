"""Sampling one token per row from the logits: temperature, top-p (through a top-k when it suffices), greedy."""

from __future__ import annotations

import torch

from vineppo.engine.api import SamplingParams

TOP_K = 32  # top-p sampling first tries the TOP_K most likely tokens (exact when they hold top_p of the mass)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Sample one token per row; return (tokens [N], log-probs [N] before top-p, float32)."""
    logits = logits.float()
    T = params.temperature
    if T <= 0:
        lp_all = torch.log_softmax(logits, dim=-1)
        tok = lp_all.argmax(dim=-1)
        return tok, lp_all.gather(1, tok.view(-1, 1)).view(-1)
    lp_all = torch.log_softmax(logits / T, dim=-1)
    if params.top_p < 1.0:
        # The nucleus lies inside the top TOP_K tokens of every row whenever their mass reaches top_p
        # (usual at T < 1); then a top-k beats a full sort, and multinomial draws from TOP_K, not the vocabulary.
        top_lp, top_idx = lp_all.topk(min(TOP_K, lp_all.shape[-1]), dim=-1)
        if not bool((top_lp.exp().sum(-1) >= params.top_p).all()):
            top_lp, top_idx = lp_all.sort(dim=-1, descending=True)
        probs = top_lp.exp()
        cum = probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p: drop tokens whose preceding mass is already >= top_p
        probs = probs.masked_fill((cum - probs) >= params.top_p, 0.0)
        choice = multinomial(probs, generator)
        tok = top_idx.gather(1, choice.view(-1, 1)).view(-1)
    else:
        tok = multinomial(lp_all.exp(), generator)
    return tok, lp_all.gather(1, tok.view(-1, 1)).view(-1)


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row; on the generator's device when it differs from the probabilities' (then moved back)."""
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).view(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
