"""Studies of credit: value accuracy against Monte Carlo truth, and where advantages fall."""
