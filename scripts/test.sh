#!/usr/bin/env bash
# Install meshplan with every test dependency (CPU-only torch, megatron-core,
# DeepSpeed, Colossal-AI, Axolotl's and LLaMA-Factory's config schemas, the tuner's optuna-dashboard and
# PostgreSQL driver, matplotlib for the topology picture; PostgreSQL itself where the script may install it) and run
# the whole test suite.
# Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt)

"${PIP[@]}" -e ".[test,torch,megatron,tune,plot,tpu]"
# MaxText, the maxtext emitter's target, needs Python >= 3.12 and cannot be installed next to this interpreter:
# its released wheel is downloaded (not installed) into build/maxtext/, where tests/emit/test_emit_maxtext.py opens
# it and checks every key the emitter writes against its configs/base.yml. The version is the emitter's
# MAXTEXT_VERSION (planner/emit/maxtext.py).
MAXTEXT_VERSION=$("$PY" -c 'from planner.emit.maxtext import MAXTEXT_VERSION; print(MAXTEXT_VERSION)')
[ -f "build/maxtext/maxtext-$MAXTEXT_VERSION-py3-none-any.whl" ] ||
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --python-version 3.12 --only-binary=:all: \
    -d build/maxtext "maxtext==$MAXTEXT_VERSION"
# DeepSpeed builds no CUDA ops on a CPU machine.
DS_BUILD_OPS=0 "${PIP[@]}" "deepspeed==0.19.8"
# colossalai 0.5.0 pins torch<=2.5.1: install it without its pins, then its real dependencies.
"${PIP[@]}" --no-deps "colossalai==0.5.0"
"${PIP[@]}" -r requirements/colossalai.txt
# torchtitan 0.2.x (the last release with TOML job files) parses the emitted TOML in tests/emit;
# its config manager needs only tyro, so it goes in without its training dependencies.
"${PIP[@]}" --no-deps "torchtitan==0.2.2"
"${PIP[@]}" "tyro>=0.9"
# The fine-tuning toolkits' config schemas (tests/emit/test_emit_axolotl.py, test_emit_llamafactory.py): Axolotl 0.9.2
# and LLaMA-Factory 0.9.4, the newest releases that take the transformers 4.51.3 Colossal-AI pins, go in without
# their training dependencies (they pin torch, peft, vLLM and GPU kernels their schemas do not import), then what
# their schema and argument modules really import (requirements/axolotl.txt, requirements/llamafactory.txt).
"${PIP[@]}" --no-deps "axolotl==0.9.2" "llamafactory==0.9.4"
"${PIP[@]}" -r requirements/axolotl.txt -r requirements/llamafactory.txt
# Megatron-Bridge needs transformers >= 4.52 while Colossal-AI needs < 4.52: its check runs in a
# separate virtual environment on top of this interpreter's packages (torch, megatron-core), named to
# the tests by MESHPLAN_BRIDGE_PYTHON. A .pth file in its site-packages adds, after its own (so its
# transformers wins), every site-packages directory $PY sees: `venv --system-site-packages` would see
# the base interpreter's instead, without what a virtual environment running this script installed.
# megatron-bridge and triton (megatron-core's Mamba specs import it) go in without their GPU dependencies.
# This is Megatron-Bridge 0.3.1 (the emitter's --bridge-version 0.3). 0.6.0, the default, needs Python 3.12 and
# a development megatron-core of Megatron-LM's main branch that no package index carries: its overrides are
# checked against field names read from its source (tests/emit/test_emit_bridge_fields.py), not installed.
BRIDGE_VENV=${MESHPLAN_BRIDGE_VENV:-build/bridge-venv}
[ -x "$BRIDGE_VENV/bin/python" ] || "$PY" -m venv "$BRIDGE_VENV"
BRIDGE_SITE=$("$BRIDGE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -c 'import site, sys
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in sys.path if p in dirs))' \
  > "$BRIDGE_SITE/meshplan-base-site.pth"
BPIP=("$BRIDGE_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt)
"${BPIP[@]}" -r requirements/megatron-bridge.txt
"${BPIP[@]}" --no-deps "megatron-bridge==0.3.1" "triton==3.9.0"
export MESHPLAN_BRIDGE_PYTHON="$(cd "$BRIDGE_VENV" && pwd)/bin/python"

# Programs some tests start, installed as root on a Debian-like machine where they are missing (one `apt-get
# update` for all of them); without them those tests are skipped, saying why. PostgreSQL: the tuner's
# multi-worker tests start a server of their own (tests/services.py). chromium: the tests that check an HTML page
# open it in a headless browser (tests/browser.py looks for the names have_chromium looks for).
apt_updated=false
apt_install() {  # apt_install PACKAGE WHAT-FOR: quietly, printing apt-get's last lines only when it fails
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
  echo "scripts/test.sh: installing $1 with apt-get for $2" >&2
  local apt_log
  if ! $apt_updated; then
    if ! apt_log=$(DEBIAN_FRONTEND=noninteractive apt-get update -qq 2>&1); then
      printf '%s\n' "$apt_log" | tail -n 5 >&2
      return 0
    fi
    apt_updated=true
  fi
  if ! apt_log=$(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" 2>&1); then
    printf '%s\n' "$apt_log" | tail -n 5 >&2
  fi
}
have_initdb() { command -v initdb >/dev/null || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; }
have_chromium() {
  command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null ||
    [ -x /usr/bin/chromium ]
}
if ! have_initdb; then
  apt_install postgresql "the tests that share a study through it"
  have_initdb || echo "scripts/test.sh: PostgreSQL is not installed: the tests that need it are skipped" >&2
fi
if ! have_chromium; then
  apt_install chromium "the tests that check HTML pages in a browser"
  have_chromium || echo "scripts/test.sh: chromium is not installed: the browser tests are skipped" >&2
fi

# Two workers (pytest-xdist): the tests that start processes run one after another on one of them
# (tests/conftest.py), the rest of the suite on both.
"$PY" -m pytest -q -n 2 --dist loadgroup "$@"
