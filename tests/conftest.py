"""Shared fixtures. Every test runs without a GPU and without network."""

from __future__ import annotations

import pytest

from benchmarks.validation import validation_dir


@pytest.fixture(scope="session")
def validation_path():
    """../shared/validation (or MESHPLAN_VALIDATION_DIR); the golden tests need it."""
    return validation_dir()
