"""Reading the user's model, cluster and config files safely.

A file is checked before it is read: it must be a regular file (not a directory, device or
pipe: `/dev/zero` would never end) of at most `MAX_FILE_BYTES`, in UTF-8. YAML is parsed with
`yaml.safe_load` after its node graph is measured: an alias bomb (a few lines whose aliases
expand to billions of nodes) is refused before anything is built from it, and so is nesting
deeper than `MAX_DEPTH`. Every problem is a SpecError naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from planner.errors import SpecError, short_repr

#: Largest model, cluster or config file read (the largest shipped file is under 100 KiB).
MAX_FILE_BYTES = 4 * 2**20
#: Most nodes a YAML document may expand to with its aliases followed.
MAX_YAML_NODES = 200_000
#: Deepest nesting of mappings and lists in a YAML or JSON file.
MAX_DEPTH = 64


def read_text(path: str | os.PathLike, what: str) -> str:
    """The text of a regular UTF-8 file of at most MAX_FILE_BYTES."""
    shown = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SpecError(f"{what} file {shown!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{what} file {shown!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise SpecError(f"{what} file {shown!r} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(f"{what} file {shown!r} is not a regular file (a device, pipe or socket)")
    if info.st_size > MAX_FILE_BYTES:
        raise SpecError(f"{what} file {shown!r} is {info.st_size:,} bytes; at most {MAX_FILE_BYTES:,} are read")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{what} file {shown!r} cannot be read: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(f"{what} file {shown!r} is larger than {MAX_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{what} file {shown!r} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _measure(node: yaml.Node, what: str) -> None:
    """Refuse a YAML node graph that expands to more than MAX_YAML_NODES nodes or nests deeper
    than MAX_DEPTH; aliases share nodes, so sizes are memoised per node (linear in the file)."""
    sizes: dict[int, int] = {}
    # iterative post-order walk: (node, depth, children done)
    stack: list[tuple[yaml.Node, int, bool]] = [(node, 1, False)]
    while stack:
        n, depth, done = stack.pop()
        if id(n) in sizes:
            continue
        if depth > MAX_DEPTH:
            raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")
        if isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        elif isinstance(n, yaml.SequenceNode):
            children = list(n.value)
        else:
            sizes[id(n)] = 1
            continue
        if done:
            total = 1 + sum(sizes[id(c)] for c in children)
            if total > MAX_YAML_NODES:
                raise SpecError(f"{what} expands to more than {MAX_YAML_NODES:,} values (aliases included); "
                                "refused")
            sizes[id(n)] = total
            continue
        if any(c is n for c in children):
            raise SpecError(f"{what} refers to itself (a recursive alias)")
        stack.append((n, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


_OPEN = (yaml.FlowSequenceStartToken, yaml.FlowMappingStartToken, yaml.BlockSequenceStartToken,
         yaml.BlockMappingStartToken)
_CLOSE = (yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken, yaml.BlockEndToken)


def _yaml_depth_ok(text: str, what: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH from the token stream, stopping at the first level too
    deep: PyYAML's scanner and composer slow down with the depth (each token looks at every open
    level) and recurse once per level, so a deep file is refused before they build anything."""
    depth = 0
    for token in yaml.scan(text, Loader=yaml.SafeLoader):
        if isinstance(token, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")
        elif isinstance(token, _CLOSE):
            depth -= 1


def parse_yaml(text: str, what: str) -> Any:
    """`yaml.safe_load` of `text` after the size and depth checks above."""
    try:
        _yaml_depth_ok(text, what)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise SpecError(f"{what} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    if node is None:
        return None
    _measure(node, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{what} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels") from None


def _refuse_constant(token: str) -> Any:
    raise SpecError(f"{token} is not a number JSON allows")


def parse_json(text: str, what: str) -> Any:
    """`json.loads` refusing NaN / Infinity (not JSON) and nesting deeper than MAX_DEPTH."""
    depth = 0
    deepest = 0
    in_string = escaped = False
    for ch in text:  # depth of brackets outside strings, before any object is built
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_DEPTH:
        raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except SpecError as exc:
        raise SpecError(f"{what}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{what} is not valid JSON: {exc}") from None
    except (RecursionError, ValueError) as exc:
        raise SpecError(f"{what} cannot be read as JSON: {exc}") from None


def load_path(path: str | Path, what: str, kind: str = "yaml") -> Any:
    """Read and parse one file (`kind` 'yaml' or 'json')."""
    text = read_text(path, what)
    where = f"{what} file {str(path)!r}"
    return parse_json(text, where) if kind == "json" else parse_yaml(text, where)


def check_tree(obj: Any, what: str) -> None:
    """A mapping loaded from JSON or built in Python: text keys, at most MAX_DEPTH levels and
    MAX_YAML_NODES values (iterative, so a deeply nested input cannot exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            raise SpecError(f"{what} holds more than {MAX_YAML_NODES:,} values")
        if depth > MAX_DEPTH:
            raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            bad = next((k for k in node if not isinstance(k, str)), None)
            if bad is not None:
                raise SpecError(f"{what} has a key that is not text: {short_repr(bad)}")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
