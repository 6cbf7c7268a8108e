"""Accuracy, calibration and speed benchmarks, and the published data they read.

Not part of the installed package (pyproject's `packages.find` leaves it out):
these modules read `benchmarks/data/` (the papers' tables in
`benchmarks/data/published/`, each row with its source) in a source checkout. Run them from the repository root, e.g.
`python -m benchmarks.calibrate` and `python -m benchmarks.accuracy`.
"""
