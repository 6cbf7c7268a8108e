"""Shared fixtures. Every test runs without a GPU and without network."""

from __future__ import annotations

import pytest

from benchmarks.validation import validation_dir
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (hooks)

pytest_plugins = ["pytester"]


@pytest.fixture(scope="session")
def validation_path():
    """../shared/validation (or MESHPLAN_VALIDATION_DIR); the golden tests need it."""
    return validation_dir()
