"""Under CI=true a test skipped for a missing dependency fails the run.

CI installs every dependency with the project's own files (scripts/test.sh); a skip
that says a module could not be imported there means an install step is missing,
which a green run must not hide. Skips for missing hardware stay skips: tests marked
`gpu`, and skip reasons that name CUDA.
"""

from __future__ import annotations

import os
import re

import pytest

#: Skip reasons that mean "a package is missing" (pytest.importorskip and our own skipif texts).
MISSING_DEPENDENCY = re.compile(r"could not import|no module named|needs (megatron|deepspeed|torch|colossal)",
                                re.IGNORECASE)
#: Skip reasons that mean "this machine lacks the hardware".
MISSING_HARDWARE = re.compile(r"cuda|gpu", re.IGNORECASE)


def _ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fails(report, gpu_marked: bool) -> bool:
    if not (report.skipped and _ci()) or gpu_marked:
        return False
    reason = _reason(report)
    return bool(MISSING_DEPENDENCY.search(reason)) and not MISSING_HARDWARE.search(reason)


def _fail(report) -> None:
    reason = _reason(report)
    report.outcome = "failed"
    report.longrepr = f"CI=true: skipped for a missing dependency, which the install must provide ({reason})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _fails(report, item.get_closest_marker("gpu") is not None):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _fails(report, False):
        _fail(report)
