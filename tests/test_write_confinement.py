"""`meshplan profile` writes only where it is told, only regular files, and never over a file without
--force: a --name that is a path, a symbolic link at a target, a folder linked into meshplan's own files,
an --output that is a file and an existing profile are all refused before anything is measured, with one
line (exit 2). The measurement itself is replaced by a stub that counts its calls (the real one takes ~10 s
and is tested in tests/executors)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from executors import profiler
from executors.profiler import check_targets, default_profile_name, profile_targets, write_profiles
from planner.cli import main
from planner.errors import SpecError
from planner.specs import files
from profiles import MAX_NAME_BYTES, PRESET_NAME, PROFILES_DIR


def _synthetic_raw() -> dict:
    """tests/executors/test_profile.py's synthetic measurement (loaded by path: that folder is not a package)."""
    spec = importlib.util.spec_from_file_location("_profile_fixture", Path(__file__).parent / "executors" /
                                                  "test_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.synthetic_raw()


RAW = _synthetic_raw()


@pytest.fixture
def measured(monkeypatch):
    """Replace the measurement with one returning RAW; the list holds one entry per call."""
    calls: list[int] = []

    def fake_run_profile(nproc, out_dir, device="cpu", quick=False, timeout_s=1200.0):
        calls.append(nproc)
        return RAW

    monkeypatch.setattr(profiler, "run_profile", fake_run_profile)
    return calls


def profile(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["profile", "--device", "cpu", "--nproc", "2", "--format", "json", *args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args: str) -> str:
    """Run `meshplan profile` expecting a refusal: exit 2, one `error:` line, no traceback; the line."""
    code, _, err = profile(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, (code, err)
    return lines[0]


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*")) if root.exists() else []


# ---- --name ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "../x", "a/b", "/tmp/absolute", ".", "..", "", "a\0b", "a\nb", "x\n", "-x", ".hidden", "p" * 300,
    "../../meshplan/profiles/clusters/dgx-h100", "../../escaped", "a\\b", "name with space",
])
def test_a_name_that_is_not_a_preset_name_is_refused_before_measuring(capsys, tmp_path, measured, name):
    out = tmp_path / "out"
    line = refused(capsys, "--name", name, "--output", str(out))
    assert "--name" in line and "must be a preset name" in line
    assert measured == [] and files_under(tmp_path) == []


def test_the_longest_preset_name_is_accepted(capsys, tmp_path, measured):
    name = "n" * (MAX_NAME_BYTES - len(".yaml"))
    code, _, err = profile(capsys, "--name", name, "--output", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / "gpus" / f"{name}.yaml").is_file() and measured == [2]


@pytest.mark.parametrize("description", [
    "NVIDIA H100 80GB HBM3", "../../meshplan/profiles/clusters/dgx-h100", "a/b\n\0c", "", "---", "G" * 1000,
    "/abs/..",
])
def test_the_default_name_is_a_preset_name(description):
    name = default_profile_name("cuda", description)
    assert PRESET_NAME.fullmatch(name) and len(name) <= MAX_NAME_BYTES - len(".yaml") and "/" not in name
    assert name.startswith("local-")
    assert default_profile_name("cuda", "NVIDIA H100 80GB HBM3") == "local-nvidia-h100-80gb-hbm3"
    assert default_profile_name("cpu", description) == "local-cpu"


def test_write_profiles_refuses_a_path_as_name(tmp_path):
    for name in ("../escaped", "a/b", str(tmp_path / "abs")):
        with pytest.raises(SpecError, match="must be a preset name"):
            write_profiles(RAW, name, tmp_path / "out")
    assert files_under(tmp_path) == []


# ---- --output ----------------------------------------------------------------------------------
def test_output_that_is_a_file_is_refused_before_measuring(capsys, tmp_path, measured):
    target = tmp_path / "profiles.yaml"
    target.write_text("mine\n")
    line = refused(capsys, "--name", "box", "--output", str(target))
    assert "is a file, not a directory" in line and str(target) in line
    assert measured == [] and target.read_text() == "mine\n"


def test_output_inside_meshplan_is_refused_before_measuring(capsys, measured):
    before = (PROFILES_DIR / "clusters" / "dgx-h100.yaml").read_bytes()
    line = refused(capsys, "--name", "dgx-h100", "--output", str(PROFILES_DIR), "--force")
    assert "inside meshplan's own files" in line and measured == []
    assert (PROFILES_DIR / "clusters" / "dgx-h100.yaml").read_bytes() == before


def test_a_folder_linked_into_meshplan_is_refused(capsys, tmp_path, measured):
    """--output is the user's, but its clusters/ is a link to the shipped presets: every final path is
    checked with its folder resolved, not only --output."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "clusters").symlink_to(PROFILES_DIR / "clusters", target_is_directory=True)
    shipped = PROFILES_DIR / "clusters" / "dgx-h100.yaml"
    before = shipped.read_bytes()
    line = refused(capsys, "--name", "dgx-h100", "--output", str(out), "--force")
    assert "inside meshplan's own files" in line and measured == []
    with pytest.raises(SpecError, match="inside meshplan's own files"):
        write_profiles(RAW, "dgx-h100", out, force=True)
    assert shipped.read_bytes() == before and not (out / "gpus").exists()


# ---- existing files and --force ----------------------------------------------------------------
def test_an_existing_profile_is_replaced_only_with_force(capsys, tmp_path, measured):
    out = tmp_path / "out"
    code, _, err = profile(capsys, "--name", "box", "--output", str(out))
    assert code == 0, err
    assert measured == [2]
    gpu = out / "gpus" / "box.yaml"
    gpu.write_text(gpu.read_text() + "# my own note\n")  # hand-edited
    line = refused(capsys, "--name", "box", "--output", str(out))
    assert f"{gpu} exists; --force replaces it" in line
    assert measured == [2] and gpu.read_text().endswith("# my own note\n")  # refused before measuring
    with pytest.raises(SpecError, match="exists; --force replaces it"):
        write_profiles(RAW, "box", out)
    code, _, err = profile(capsys, "--name", "box", "--output", str(out), "--force")
    assert code == 0, err
    assert measured == [2, 2] and "# my own note" not in gpu.read_text()


def test_any_existing_file_of_the_profile_needs_force(tmp_path):
    """A kernel table alone (e.g. kept from an earlier run) counts: the run would replace or remove it."""
    table = tmp_path / "kernels" / "gemm" / "box.yaml"
    table.parent.mkdir(parents=True)
    table.write_text("hand made\n")
    with pytest.raises(SpecError, match=f"{table} exists; --force replaces it"):
        check_targets("box", tmp_path)
    check_targets("box", tmp_path, force=True)
    assert table.read_text() == "hand made\n"


def test_a_symbolic_link_at_a_target_is_refused_even_with_force(capsys, tmp_path, measured):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    (out / "gpus").mkdir(parents=True)
    (out / "gpus" / "box.yaml").symlink_to(victim)
    line = refused(capsys, "--name", "box", "--output", str(out), "--force")
    assert "is a symbolic link" in line and measured == []
    with pytest.raises(SpecError, match="is a symbolic link"):
        write_profiles(RAW, "box", out, force=True)
    assert victim.read_text() == "precious\n" and (out / "gpus" / "box.yaml").is_symlink()
    assert not (out / "clusters").exists()


def test_a_dangling_link_is_refused_too(tmp_path):
    out = tmp_path / "out"
    (out / "clusters").mkdir(parents=True)
    (out / "clusters" / "box.yaml").symlink_to(tmp_path / "would-be-created.yaml")
    with pytest.raises(SpecError, match="is a symbolic link"):
        write_profiles(RAW, "box", out, force=True)
    assert not (tmp_path / "would-be-created.yaml").exists()


def test_a_target_that_is_a_folder_or_under_a_file_is_refused(tmp_path):
    (tmp_path / "a" / "gpus" / "box.yaml").mkdir(parents=True)
    with pytest.raises(SpecError, match="is not a regular file"):
        check_targets("box", tmp_path / "a", force=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "kernels").write_text("a file\n")
    with pytest.raises(SpecError, match="is a file, not a directory"):
        check_targets("box", tmp_path / "b", force=True)


# ---- how the files are written -----------------------------------------------------------------
def test_files_are_written_whole_with_ordinary_permissions(tmp_path):
    gpu_path, cluster_path = write_profiles(RAW, "box", tmp_path)
    written = [p for p in profile_targets("box", tmp_path) if p.exists()]
    assert gpu_path in written and cluster_path in written and len(written) >= 4
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left beside them
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in written} == {0o666 & ~mask}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    write_profiles(RAW, "box", tmp_path)
    gpu = tmp_path / "gpus" / "box.yaml"
    before = gpu.read_text()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", broken_replace)  # the writer: planner.specs.files.write_whole
    with pytest.raises(OSError):
        write_profiles(RAW, "box", tmp_path, force=True)
    assert gpu.read_text() == before and not list(tmp_path.rglob("*.tmp"))
