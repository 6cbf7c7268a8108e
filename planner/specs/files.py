"""Reading the user's model, cluster, config and plan files safely: the one reader of every input file.

A file is checked before it is read: it must be a regular file (not a directory, device or
pipe: `/dev/zero` would never end) of at most `MAX_FILE_BYTES`, in UTF-8; '-' reads at most that
much of standard input (plan files, JSON only: `MAX_PLAN_FILE_BYTES` and `MAX_PLAN_VALUES`). The work of parsing is bounded too: YAML's event stream (libyaml's
parser where PyYAML has it) is counted first, so more than `MAX_VALUES` values or nesting deeper
than `MAX_DEPTH` is refused before a node is built; then an alias bomb (a few lines whose aliases
expand to billions of nodes) is refused before anything is constructed from it. JSON's commas and
brackets outside strings are counted the same way before `json.loads`. A key repeated in one
mapping is refused (YAML and JSON keep the last one silently). Every problem is a SpecError naming
the file.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import sys
from pathlib import Path
from typing import Any

import yaml

from planner.errors import SpecError, short_repr

#: Largest model, cluster or config file read (the largest shipped file is under 100 KiB).
MAX_FILE_BYTES = 4 * 2**20
#: Most values (mappings, lists and scalars, keys included) a file may hold, and a YAML document expand
#: to with its aliases followed.
MAX_VALUES = 200_000
#: Deepest nesting of mappings and lists in a YAML or JSON file.
MAX_DEPTH = 64
#: Largest plan file (`meshplan plan --format json`, ~11 KB a plan) read by emit, evaluate and validate:
#: 3,000 plans (32 MB, 1.5 million values) parse and validate in about 2 s and 150 MiB. Only JSON is
#: read under these larger bounds (its parser is C; YAML's would take minutes).
MAX_PLAN_FILE_BYTES = 64 * 2**20
#: Most values a plan file may hold.
MAX_PLAN_VALUES = 4_000_000


def _check_kind(info: os.stat_result, shown: str, what: str, max_bytes: int) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise SpecError(f"{what} file {shown!r} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(f"{what} file {shown!r} is not a regular file (a device, pipe or socket)")
    if info.st_size > max_bytes:
        raise SpecError(f"{what} file {shown!r} is {info.st_size:,} bytes; at most {max_bytes:,} are read")


def read_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of a regular UTF-8 file of at most `max_bytes`. A device or pipe is refused
    before it is opened (opening some devices acts); the file is then opened without blocking and
    checked again on the open descriptor, so it cannot be swapped for one in between."""
    shown = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SpecError(f"{what} file {shown!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{what} file {shown!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    _check_kind(info, shown, what, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SpecError(f"{what} file {shown!r} cannot be read: {exc.strerror}") from None
    try:
        _check_kind(os.fstat(fd), shown, what, max_bytes)
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise SpecError(f"{what} file {shown!r} cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    return _text(data, f"{what} file {shown!r}", max_bytes)


def _text(data: bytes, where: str, max_bytes: int) -> str:
    """`data` (read up to max_bytes + 1) as UTF-8 text, or a SpecError naming `where`."""
    if len(data) > max_bytes:
        raise SpecError(f"{where} is larger than {max_bytes:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{where} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def read_input(path: str, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """`read_text` of a file path, or for '-' at most `max_bytes` of standard input (UTF-8)."""
    if path != "-":
        return read_text(path, what, max_bytes)
    stream = getattr(sys.stdin, "buffer", None)  # a text stream without one (embedding, tests): characters
    try:
        data = (stream.read(max_bytes + 1) if stream is not None
                else sys.stdin.read(max_bytes + 1).encode("utf-8", "surrogateescape"))
    except OSError as exc:
        raise SpecError(f"{what} on standard input cannot be read: {exc.strerror}") from None
    return _text(data, f"{what} on standard input", max_bytes)


def _measure(node: yaml.Node, what: str) -> None:
    """Refuse a YAML node graph that expands to more than MAX_VALUES nodes or nests deeper
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
            if total > MAX_VALUES:
                raise SpecError(f"{what} expands to more than {MAX_VALUES:,} values (aliases included); refused")
            sizes[id(n)] = total
            continue
        if any(c is n for c in children):
            raise SpecError(f"{what} refers to itself (a recursive alias)")
        stack.append((n, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


#: libyaml's parser where PyYAML was built with it (C, tens of times faster), else PyYAML's own;
#: both safe (plain data only).
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NODE_EVENTS = (yaml.ScalarEvent, yaml.AliasEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)
_OPEN_EVENTS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE_EVENTS = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


class _UniqueKeyLoader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a mapping that repeats a key (YAML keeps the last one silently).
    Keys merged in with `<<` may be overridden; only the mapping's own keys must differ."""

    what = "YAML"

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=False)
                try:
                    hash(key)
                except TypeError:
                    continue  # the constructor refuses it itself ("found unhashable key")
                if key in seen:
                    raise SpecError(f"{self.what} repeats the key {short_repr(key)} on line "
                                    f"{key_node.start_mark.line + 1}; each key may appear once in a mapping")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_shape_ok(text: str, what: str) -> bool:
    """Refuse more than MAX_VALUES nodes or nesting deeper than MAX_DEPTH from the event stream,
    stopping at the first node too many or level too deep: nothing is built before the file is known
    to be small enough (composing a 4 MiB list of a million numbers took close to a minute and over a GB).
    Whether the stream holds an alias (only then can the document expand beyond what was counted)."""
    depth = nodes = 0
    aliases = False
    for event in yaml.parse(text, Loader=_BASE_LOADER):
        if isinstance(event, _NODE_EVENTS):
            aliases = aliases or isinstance(event, yaml.AliasEvent)
            nodes += 1
            if nodes > MAX_VALUES:
                raise SpecError(f"{what} holds more than {MAX_VALUES:,} values; refused")
        if isinstance(event, _OPEN_EVENTS):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")
        elif isinstance(event, _CLOSE_EVENTS):
            depth -= 1
    return aliases


def parse_yaml(text: str, what: str) -> Any:
    """The plain data of one YAML document (as `yaml.safe_load`), after the count and depth checks
    above and, for a document with aliases, the expansion check (`_measure`); repeated keys refused."""
    try:
        aliases = _yaml_shape_ok(text, what)
        loader = _UniqueKeyLoader(text)
        loader.what = what
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if aliases:
                _measure(node, what)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # libyaml >= 0.2.5 stops at its own limit (1,000 levels)
            raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels") from None
        raise SpecError(f"{what} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels") from None


def _refuse_constant(token: str) -> Any:
    raise SpecError(f"{token} is not a number JSON allows")


class _RepeatedKey(Exception):
    """A JSON object names one key twice (`parse_json` says which file)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise _RepeatedKey(key, seen[key], value)
            seen[key] = value
    return out


#: A JSON string, escapes included (replaced by "" before brackets and commas are counted).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_BRACKETS = re.compile(r"[\[\]{}]")


def _json_shape_ok(text: str, what: str, max_values: int) -> None:
    """Refuse more than `max_values` values, keys counted as in YAML's event stream (commas, colons and
    opening brackets outside strings), or nesting deeper than MAX_DEPTH, before json.loads builds
    anything."""
    bare = _JSON_STRING.sub('""', text)
    values = 1 + bare.count(",") + bare.count(":") + bare.count("[") + bare.count("{")
    if values > max_values:
        raise SpecError(f"{what} holds more than {max_values:,} values; refused")
    depth = 0
    for match in _JSON_BRACKETS.finditer(bare):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DEPTH:
            raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")


def _int_of_at_most(digits: int):
    def parse_int(token: str) -> int:
        if len(token.lstrip("-")) > digits:
            raise SpecError(f"integers must have at most {digits} digits (got one of {len(token.lstrip('-')):,} "
                            "digits)")
        return int(token)
    return parse_int


def parse_json(text: str, what: str, max_values: int = MAX_VALUES, max_int_digits: int | None = None) -> Any:
    """`json.loads` refusing NaN / Infinity (not JSON), a key repeated in one object, more than
    `max_values` values, nesting deeper than MAX_DEPTH and, when given, an integer of more than
    `max_int_digits` digits (Python itself reads none of more than 4,300)."""
    _json_shape_ok(text, what, max_values)
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys,
                          parse_int=_int_of_at_most(max_int_digits) if max_int_digits else None)
    except _RepeatedKey as exc:
        key, first, second = exc.args
        raise SpecError(f"{what} repeats the key {short_repr(key)} in one object ({short_repr(first)} and "
                        f"{short_repr(second)}); each key may appear once") from None
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
    MAX_VALUES values (iterative, so a deeply nested input cannot exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise SpecError(f"{what} holds more than {MAX_VALUES:,} values")
        if depth > MAX_DEPTH:
            raise SpecError(f"{what} nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            bad = next((k for k in node if not isinstance(k, str)), None)
            if bad is not None:
                raise SpecError(f"{what} has a key that is not text: {short_repr(bad)}")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


def write_whole(path: Path, text: str | bytes) -> None:
    """Write `path` (text as UTF-8, or bytes) whole or not at all: a temporary file in its folder, then os.replace, which replaces
    the name (a symbolic link there is replaced, never followed: callers refuse one first). The file
    keeps its present mode, or gets an ordinary new file's (0o666 less the umask; mkstemp's is private)."""
    mask = os.umask(0)
    os.umask(mask)
    try:
        mode = stat.S_IMODE(os.lstat(path).st_mode) if os.path.isfile(path) and not os.path.islink(path) \
            else 0o666 & ~mask
    except OSError:
        mode = 0o666 & ~mask
    fd, tmp = tempfile.mkstemp(prefix=".meshplan-", suffix=".tmp", dir=Path(path).parent)  # short: any name fits
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(text if isinstance(text, bytes) else text.encode("utf-8"))
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
