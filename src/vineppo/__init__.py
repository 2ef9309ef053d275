"""vineppo: RL fine-tuning of language models with Monte Carlo credit assignment (VinePPO)."""

__version__ = "0.1.0"
