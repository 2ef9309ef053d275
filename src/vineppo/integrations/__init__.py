"""vineppo's credit assignment inside other trainers. `trl` (`pip install "vineppo[trl]"`): `VinePPOTrainer` and
`TempoTrainer`, TRL's `GRPOTrainer` with per-token advantages from vineppo's own estimators (docs/trl.md). Nothing of
the package imports this folder: importing it is for the users of the trainer it serves.
"""
