"""Where profile files are found and how they are read: the profile roots (`search_dirs`) and a
cached, safe YAML reader (`read_yaml`). Every loader in `profiles` reads through here."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

from planner.errors import SpecError
from planner.specs.files import load_path

PROFILES_DIR = Path(__file__).resolve().parent


def user_profiles_dir() -> Path:
    """The user's own profiles root, where `meshplan profile` writes by default:
    $XDG_DATA_HOME/meshplan/profiles, else ~/.local/share/meshplan/profiles."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "meshplan" / "profiles"


def search_dirs() -> list[Path]:
    """Profile roots, first match wins: MESHPLAN_PROFILES, the user's own (when it exists), the shipped files."""
    extra = [Path(p) for p in os.environ.get("MESHPLAN_PROFILES", "").split(os.pathsep) if p]
    user = user_profiles_dir()
    return [*extra, *([user] if user.is_dir() else []), PROFILES_DIR]


def find_file(kind: str, name: str) -> Path | None:
    """`<root>/<kind>/<name>.yaml` in the first profile root that has it, or None."""
    for root in search_dirs():
        path = root / kind / f"{name}.yaml"
        if path.exists():
            return path
    return None


def file_stamp(path: Path, what: str) -> tuple[str, int, int]:
    """(path, modification time, size) of a profile file: the key its parsed contents are cached by."""
    try:
        stat = Path(path).stat()
    except FileNotFoundError:
        raise SpecError(f"{what} file {str(path)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{what} file {str(path)!r} cannot be read: {exc}") from None
    return str(path), stat.st_mtime_ns, stat.st_size


def read_yaml(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping with safe_load; errors name the file and the problem (a missing,
    oversized, non-regular, non-UTF-8, too deeply nested or alias-bombed file is refused:
    `planner.specs.files`). A file is parsed once per (path, modification time, size);
    callers get their own copy."""
    return copy.deepcopy(parsed_yaml(path, what))


def parsed_yaml(path: Path, what: str) -> dict[str, Any]:
    """`read_yaml` without the copy: the cached mapping itself, which callers must not change."""
    return _parsed_yaml(*file_stamp(path, what), what)


@functools.lru_cache(maxsize=256)
def _parsed_yaml(path: str, mtime_ns: int, size: int, what: str) -> dict[str, Any]:
    data = load_path(path, what, "json" if path.endswith(".json") else "yaml")
    if not isinstance(data, dict):
        raise SpecError(f"{what} file {path!r} must hold a mapping, not {type(data).__name__}")
    return data
