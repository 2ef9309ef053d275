"""The rollout engine: batched sampling with KV-cache reuse for responses, Monte Carlo continuations and evaluation.

INTERFACE (fixed; other modules are written against it):

    params = SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=256, stop=("\n\nProblem:",))
    engine = Engine(model, tokenizer, token_budget=65536)
    out = engine.generate(prompts, n=8, params=params, generator=g)   # list (per prompt) of list (n) of Sample
    mc  = engine.continuations(sequences, boundaries, k=9, params=params, generator=g)
          # mc[i][j] = k Samples continuing sequences[i][:boundaries[i][j]]
"""
