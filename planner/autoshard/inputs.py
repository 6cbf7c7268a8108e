"""What the command line (and the runners) say about a module to solve: the factory that builds it and the
shapes of its inputs, parsed without evaluating anything.

A factory is named as ``package.module:function`` (the form uvicorn and gunicorn use): the module is imported
like any Python import - its code runs, as `python -m` would run it - and the function called with keyword
arguments given as ``key=value``. The function must be defined in that module (not imported into it from
elsewhere) and the module must not be part of the standard library, so a name such as ``os:system`` is refused
rather than called (ints, floats, booleans and plain strings; nothing is evaluated). An input is
``8,1024`` (float32), ``8,1024:int64:50304`` (integers below 50304, such as token ids) or ``8,3,224,224:bfloat16``.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any, Callable

from planner.autoshard.ops import DTYPE_BYTES
from planner.autoshard.trace import InputSpec
from planner.errors import SpecError

FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_INT = re.compile(r"^-?\d+$")
_FLOAT = re.compile(r"^-?(\d+\.\d*|\.\d+|\d+)([eE]-?\d+)?$")
_NAME = re.compile(r"^[A-Za-z_]\w*$")
#: Largest size of one input dimension (and of an integer input's range) accepted.
MAX_DIM = 2**31


def parse_input(text: str) -> InputSpec:
    """``SHAPE[:DTYPE[:HIGH]]`` -> InputSpec (module docstring)."""
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise SpecError(f"input_shape: {text!r} must be SHAPE[:DTYPE[:HIGH]], e.g. 8,1024:int64:50304")
    dims = parts[0].split(",")
    if not all(_INT.match(d.strip()) and 0 < int(d) <= MAX_DIM for d in dims):
        raise SpecError(f"input_shape: {parts[0]!r} must be positive integers separated by commas")
    dtype = parts[1].strip() if len(parts) > 1 and parts[1].strip() else "float32"
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"input_shape: dtype {dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    high = None
    if len(parts) == 3:
        if not _INT.match(parts[2].strip()) or not 0 < int(parts[2]) <= MAX_DIM:
            raise SpecError(f"input_shape: the integer range {parts[2]!r} must be a positive integer")
        if dtype.startswith("float") or dtype == "bfloat16":
            raise SpecError(f"input_shape: an integer range is given for a {dtype} input")
        high = int(parts[2])
    elif not (dtype.startswith("float") or dtype == "bfloat16" or dtype == "bool"):
        raise SpecError(f"input_shape: the {dtype} input {text!r} needs its range, e.g. {parts[0]}:{dtype}:1000")
    return InputSpec(tuple(int(d) for d in dims), dtype, high)


def parse_factory_arg(text: str) -> tuple[str, Any]:
    """``key=value`` with value an int, a float, true/false or a plain string."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not _NAME.match(key):
        raise SpecError(f"factory_arg: {text!r} must be NAME=VALUE")
    if _INT.match(value):
        return key, int(value)
    if _FLOAT.match(value):
        return key, float(value)
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


def load_factory(path: str, app_dir: str | None = ".") -> Callable[..., Any]:
    """Import ``package.module:function`` (from `app_dir` first, as uvicorn's --app-dir) and return it."""
    if not isinstance(path, str) or not FACTORY.match(path):
        raise SpecError(f"factory: {path!r} must be package.module:function")
    module_name, name = path.split(":")
    if module_name.split(".")[0] in sys.stdlib_module_names:
        raise SpecError(f"factory: {module_name!r} is a standard-library module, not a model's")
    if app_dir is not None:
        folder = str(Path(app_dir).resolve())
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise SpecError(f"factory: cannot import {module_name!r} ({err.msg})") from None
    except SyntaxError as err:
        raise SpecError(f"factory: {module_name!r} does not compile: {err.msg} (line {err.lineno})") from None
    except Exception as err:  # the user's module failed while importing: one line, not its traceback
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise SpecError(f"factory: importing {module_name!r} failed: {type(err).__name__}: {first}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SpecError(f"factory: {module_name!r} has no callable {name!r}")
    if getattr(factory, "__module__", None) != module_name:  # a name it imported from elsewhere is not its factory
        raise SpecError(f"factory: {name!r} is not defined in {module_name!r} (it comes from "
                        f"{getattr(factory, '__module__', '?')!r}); name the module that defines it")
    return factory
