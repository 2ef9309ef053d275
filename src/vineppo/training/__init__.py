"""The RL loop and its updates: the trainer, the algorithms, the PPO update, evaluation, run folders."""
