"""Shared fixtures. Every test runs without a GPU and without network."""

from __future__ import annotations

import pytest

from benchmarks.validation import validation_dir
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (hooks)

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="session")
def _no_user_profiles(tmp_path_factory):
    """Profiles a user measured with `meshplan profile` (under $XDG_DATA_HOME) replace shipped presets
    of the same name; the suite always reads the shipped ones."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    mp.delenv("MESHPLAN_PROFILES", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def validation_path():
    """../shared/validation (or MESHPLAN_VALIDATION_DIR); the golden tests need it."""
    return validation_dir()
