"""The ground floor: errors, settings, ranks, steps, logging, rewards, graders; no model code."""
