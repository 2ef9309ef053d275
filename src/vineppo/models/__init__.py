"""Models and what surrounds them: loading causal LMs, prompt formats, sharding and bf16, LoRA."""
