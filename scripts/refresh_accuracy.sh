#!/usr/bin/env bash
# Re-fit the A100 calibration and rewrite every accuracy figure from this checkout's
# code: profiles/calibration/*.yaml (python -m benchmarks.calibrate, then the newer GPUs'
# sustained_compute_fraction, python -m benchmarks.generations, then every GPU's error
# band, python -m benchmarks.residuals --write), the tables in
# README.md (python -m benchmarks.accuracy --update-readme), then print the
# sensitivity study that the profiles' kernel_overhead_source and
# comm_overlap_source quote (python -m benchmarks.sensitivity). Exits 1 when an
# accuracy target is missed (the figures are written all the same).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -m benchmarks.calibrate
"$PY" -m benchmarks.generations
"$PY" -m benchmarks.residuals --write
status=0
"$PY" -m benchmarks.accuracy --update-readme || status=$?
"$PY" -m benchmarks.sensitivity
exit "$status"
