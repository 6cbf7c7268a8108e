#!/usr/bin/env bash
# Install meshplan with every test dependency (CPU-only torch, megatron-core,
# DeepSpeed, Colossal-AI) and run the whole test suite. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt)

"${PIP[@]}" -e ".[test,torch,megatron]"
# DeepSpeed builds no CUDA ops on a CPU machine.
DS_BUILD_OPS=0 "${PIP[@]}" "deepspeed==0.19.8"
# colossalai 0.5.0 pins torch<=2.5.1: install it without its pins, then its real dependencies.
"${PIP[@]}" --no-deps "colossalai==0.5.0"
"${PIP[@]}" -r requirements/colossalai.txt
# torchtitan 0.2.x (the last release with TOML job files) parses the emitted TOML in tests/emit;
# its config manager needs only tyro, so it goes in without its training dependencies.
"${PIP[@]}" --no-deps "torchtitan==0.2.2"
"${PIP[@]}" "tyro>=0.9"

"$PY" -m pytest -q "$@"
