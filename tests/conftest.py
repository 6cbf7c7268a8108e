"""Shared fixtures. Every test runs without a GPU and without network."""

from __future__ import annotations

import os

import pytest

from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (hooks)

# services: the fixtures of the real services some tests start (PostgreSQL, optuna-dashboard); browser: the
# headless chromium that checks HTML pages (the `browser_page` fixture).
pytest_plugins = ["pytester", "services", "browser"]

# The CLI sizes its tables by COLUMNS when it is set (planner/cli/common.py, read at import), and the tests
# read its output as a pipe's, without it; pytest-xdist's workers inherit COLUMNS=80 from execnet.
os.environ.pop("COLUMNS", None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group into the test ids
def pytest_collection_modifyitems(config, items):
    """Tests that start processes of their own (torchrun and gloo runs, executor workers, the services of
    tests/services.py: tests marked `services`, chromium: tests marked `browser`) share one xdist group: under `pytest -n 2 --dist loadgroup`
    (scripts/test.sh) they run one after another on one worker, so two multi-process runs never compete
    for the cores and their timeouts hold, while the rest of the suite runs on the other worker."""
    group = pytest.mark.xdist_group("processes")
    for item in items:
        if (any(item.get_closest_marker(name) for name in ("executor", "services", "browser"))
                or "executors" in item.path.parts):
            item.add_marker(group)


@pytest.fixture(autouse=True, scope="session")
def _no_user_profiles(tmp_path_factory):
    """Profiles a user measured with `meshplan profile` (under $XDG_DATA_HOME) replace shipped presets
    of the same name; the suite always reads the shipped ones."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    mp.delenv("MESHPLAN_PROFILES", raising=False)
    yield
    mp.undo()
