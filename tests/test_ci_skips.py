"""The CI skip policy (tests/ci_skips.py): under CI=true a skip for a missing dependency
fails the run; a skip for missing hardware stays a skip (issue #7, part 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

POLICY = (Path(__file__).parent / "ci_skips.py").read_text()
SUITE = """
import pytest

def test_missing_package():
    pytest.importorskip("meshplan_no_such_package")

@pytest.mark.skipif(True, reason="needs CUDA")
def test_no_gpu():
    pass

def test_plain():
    pass
"""


@pytest.mark.parametrize("ci,failed", [("true", 1), ("", 0)])
def test_missing_dependency_skip_fails_only_under_ci(pytester, monkeypatch, ci, failed):
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(POLICY)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=2 - failed, failed=failed)
    if failed:
        result.stdout.fnmatch_lines(["*CI=true: skipped for a missing dependency*meshplan_no_such_package*"])


def test_module_level_importorskip_fails_under_ci(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    pytester.makeconftest(POLICY)
    pytester.makepyfile(test_mod='import pytest\npytest.importorskip("meshplan_no_such_package")\n'
                                 'def test_x():\n    pass\n')
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*CI=true: skipped for a missing dependency*"])
