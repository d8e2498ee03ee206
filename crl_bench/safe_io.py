"""Reading files that other people wrote: submissions, summaries, run files, config files.

Everything here treats its input as hostile. One reader (:func:`read_text`) refuses what could turn
a check into an attack on the machine running it, and two parsers on top of it bound what parsing
and the code after it can be made to do:

* :func:`read_text`: the file must be a regular file whose real path (symbolic links resolved) lies
  inside ``root`` (by default the folder holding it), so a ``metadata.yaml`` linked to
  ``/etc/shadow`` is refused before a byte of it is read; at most ``max_bytes`` are read; the bytes
  must be UTF-8 (the error gives the offset of the first bad byte).
* :func:`copy_inside`: :func:`read_text`'s checks for a file copied as bytes (a run's
  ``config.yaml`` and ``episodes.jsonl`` packed into a submission).
* :func:`load_json`: nesting depth at most ``max_depth``; integers of at most :data:`MAX_INT_DIGITS`
  digits; ``NaN``, ``Infinity`` and numbers that overflow to infinity (``1e999``) are refused.
* :func:`load_yaml`: the YAML safe loader (no Python objects), nesting depth at most ``max_depth``,
  at most ``max_aliases`` alias references (``*name``; 0 refuses every alias) and at most
  ``max_nodes`` nodes once every alias is expanded, so a "billion laughs" document (aliases of
  aliases, small on disk and astronomically large expanded) is refused at parse time instead of
  hanging whatever walks the result; integers of at most :data:`MAX_INT_DIGITS` digits; with
  ``finite=True`` also no ``.nan``/``.inf``.

Each problem raises :class:`InputFileError`, a ``ValueError`` whose message starts with the file's
path, so callers report it per file and go on with the next one.

:func:`printable` is the other half: text read from such files (or from an experience bank) that is
printed to a terminal or written into HTML gets its control characters escaped.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

#: Largest file :func:`read_text` reads by default (bytes).
MAX_BYTES = 16 * 1024 * 1024
#: Deepest nesting of lists and mappings accepted by default.
MAX_DEPTH = 64
#: Most digits of one integer (Python refuses to parse more than 4300; no field needs more than 20).
MAX_INT_DIGITS = 100
#: Most nodes of a YAML document with every alias expanded, by default.
MAX_YAML_NODES = 100_000


class InputFileError(ValueError):
    """A file read as untrusted input is refused: unreadable, outside its folder, too large, not
    UTF-8, not valid JSON/YAML, or over one of the limits.

    Attributes:
        path: the file as the caller named it.
        problem: what is wrong, without the path.
    """

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


# ---- the file --------------------------------------------------------------------------------------
def _regular_file_inside(path: str | os.PathLike, root: str | os.PathLike | None, max_bytes: int) -> tuple[Path, Path]:
    """``(path, its real path)`` once checked: it exists, its real path lies in ``root`` (default: the
    folder holding ``path``), it is a regular file (a FIFO or device would block or never end) of at
    most ``max_bytes``.

    Raises:
        InputFileError: naming ``path`` and the check it failed.
    """
    p = Path(path)
    base = Path(root) if root is not None else p.parent
    try:
        real = p.resolve(strict=True)
    except FileNotFoundError:
        raise InputFileError(p, "missing") from None
    except (OSError, RuntimeError) as e:                    # RuntimeError: a symlink loop
        raise InputFileError(p, f"cannot be resolved ({e})") from None
    if not real.is_relative_to(base.resolve()):
        raise InputFileError(p, f"is a symbolic link to a file outside {str(base)!r}; refused (files read "
                                f"from a folder must be inside it)")
    try:
        st = os.stat(real)
    except OSError as e:
        raise InputFileError(p, f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(p, "not a regular file")
    if st.st_size > max_bytes:
        raise InputFileError(p, f"{st.st_size} bytes, more than the {max_bytes} accepted")
    return p, real


def read_text(path: str | os.PathLike, root: str | os.PathLike | None = None, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``, read as untrusted input.

    Args:
        path: the file.
        root: the folder the file's real path must lie in (default: the folder holding ``path``, so
            a symbolic link to a sibling file is fine and one that leaves the folder is not).
        max_bytes: largest size accepted.

    Returns:
        The decoded text.

    Raises:
        InputFileError: missing; a symbolic link that resolves outside ``root``; not a regular file
            (a folder, a FIFO, a device); larger than ``max_bytes``; unreadable; not UTF-8.
    """
    p, real = _regular_file_inside(path, root, max_bytes)
    try:
        with open(real, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputFileError(p, f"cannot be read ({e.strerror or e})") from None
    if len(data) > max_bytes:                               # grew since the stat
        raise InputFileError(p, f"more than the {max_bytes} bytes accepted")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(p, f"not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def copy_inside(path: str | os.PathLike, dst: Any, root: str | os.PathLike | None = None,
                max_bytes: int = MAX_BYTES) -> int:
    """Copy the bytes of ``path`` into the open binary file ``dst`` with :func:`read_text`'s checks
    (a regular file whose real path lies in ``root``, at most ``max_bytes``), in chunks, without
    decoding; returns the bytes copied.

    Raises:
        InputFileError: as :func:`read_text` (not UTF-8 aside).
    """
    p, real = _regular_file_inside(path, root, max_bytes)
    copied = 0
    try:
        f = open(real, "rb")                                # closed by the with below
    except OSError as e:
        raise InputFileError(p, f"cannot be read ({e.strerror or e})") from None
    with f:
        while True:
            try:
                chunk = f.read(1 << 20)
            except OSError as e:
                raise InputFileError(p, f"cannot be read ({e.strerror or e})") from None
            if not chunk:
                return copied
            copied += len(chunk)
            if copied > max_bytes:                          # grew since the stat
                raise InputFileError(p, f"more than the {max_bytes} bytes accepted")
            dst.write(chunk)


def _depth(data: Any) -> int:
    """Deepest nesting of lists/dicts in ``data`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in item)
    return deepest


def nonfinite_paths(data: Any, path: str = "$") -> list[str]:
    """JSON paths (``$.runs[0].eval...``) of every float in ``data`` that is NaN or infinite, in
    document order; walks lists and dicts without recursion."""
    out: list[str] = []
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack:
        item, here = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            out.append(here)
        elif isinstance(item, dict):
            stack.extend(reversed([(v, f"{here}.{k}") for k, v in item.items()]))
        elif isinstance(item, list):
            stack.extend(reversed([(v, f"{here}[{i}]") for i, v in enumerate(item)]))
    return out


# ---- JSON ------------------------------------------------------------------------------------------
def parse_json(text: str, source: str | os.PathLike, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON ``text`` with the limits of :func:`load_json` (``source`` names it in errors).

    Raises:
        InputFileError: not valid JSON; ``NaN``/``Infinity``/an overflowing float; an integer of
            more than :data:`MAX_INT_DIGITS` digits; nested deeper than ``max_depth``.
    """
    def constant(name: str) -> Any:
        raise InputFileError(source, f"{name} is not a finite number (JSON has none; write a number or null)")

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise InputFileError(source, f"an integer of {len(digits.lstrip('-'))} digits (at most "
                                         f"{MAX_INT_DIGITS} accepted)")
        return int(digits)

    def number(text_: str) -> float:
        value = float(text_)
        if not math.isfinite(value):
            raise InputFileError(source, f"{text_[:40]} is not a finite number (it overflows a float)")
        return value

    try:
        data = json.loads(text, parse_constant=constant, parse_int=integer, parse_float=number)
    except json.JSONDecodeError as e:
        raise InputFileError(source, f"not valid JSON ({e})") from None
    except RecursionError:
        raise InputFileError(source, f"nested deeper than the {max_depth} levels accepted") from None
    if _depth(data) > max_depth:
        raise InputFileError(source, f"nested deeper than the {max_depth} levels accepted")
    return data


def load_json(path: str | os.PathLike, root: str | os.PathLike | None = None, max_bytes: int = MAX_BYTES,
              max_depth: int = MAX_DEPTH) -> Any:
    """Read ``path`` (:func:`read_text`) and parse it as JSON (:func:`parse_json`).

    Raises:
        InputFileError: any problem of either, the message naming ``path``.
    """
    return parse_json(read_text(path, root, max_bytes), path, max_depth)


# ---- YAML ------------------------------------------------------------------------------------------
class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit, an alias limit and a cap on integer digits; the
    expansion limit is checked on the composed node graph (:func:`_expanded_size`)."""

    max_depth = MAX_DEPTH
    max_aliases = 0

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > self.max_aliases:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, "aliases (*name) are not accepted here" if self.max_aliases == 0
                    else f"more than {self.max_aliases} aliases (*name)", mark)
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than the {self.max_depth} levels "
                                                              "accepted", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        """A mapping, refusing a key written twice in it (PyYAML keeps the last silently, so a config
        that sets a key twice would run with one of the two values unnoticed). Keys brought in by a
        merge (``<<: *base``) may be overridden, as YAML intends."""
        if isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(None, None, f"key {printable(key_node.value)[:80]!r} "
                                                                "is given twice in one mapping", key_node.start_mark)
                    seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> int:
        digits = str(node.value).replace("_", "")
        if len(digits) > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(digits)} characters (at "
                                                                f"most {MAX_INT_DIGITS} accepted)", node.start_mark)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _expanded_size(root: yaml.Node, limit_nodes: int, limit_depth: int) -> str | None:
    """What is wrong with the node graph ``root`` once every alias is expanded: more than
    ``limit_nodes`` nodes, deeper than ``limit_depth`` levels, or a recursive alias; None if nothing.

    Shared nodes (the targets of aliases) are measured once (memoised by identity), so the check
    costs the size of the graph, not of its expansion."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            if size[key] > limit_nodes:
                return f"more than {limit_nodes} values once its aliases are expanded"
            if height[key] > limit_depth:
                return f"nested deeper than the {limit_depth} levels accepted once its aliases are expanded"
            continue
        if key in size:
            continue
        on_path.add(key)
        stack.append((node, True))
        for c in children:
            if id(c) in on_path:
                return "a recursive alias (a node that contains itself)"
            if id(c) not in size:
                stack.append((c, False))
    return None


def parse_yaml(text: str, source: str | os.PathLike, max_depth: int = MAX_DEPTH, max_aliases: int = 0,
               max_nodes: int = MAX_YAML_NODES, finite: bool = False) -> Any:
    """Parse YAML ``text`` with the limits of :func:`load_yaml` (``source`` names it in errors).

    Raises:
        InputFileError: not valid YAML, or over a limit.
    """
    try:        # the reader checks the characters when it is made (a NUL byte is a ReaderError)
        loader = type("_Loader", (_BoundedLoader,), {"max_depth": max_depth, "max_aliases": max_aliases})(text)
    except yaml.YAMLError as e:
        raise InputFileError(source, f"not valid YAML ({_yaml_message(e)})") from None
    problem = None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        problem = _expanded_size(node, max_nodes, max_depth)
        if problem is None:
            data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise InputFileError(source, f"not valid YAML ({_yaml_message(e)})") from None
    except (ValueError, OverflowError) as e:          # a scalar that resolves but does not convert, e.g. 2025-13-45
        raise InputFileError(source, f"not valid YAML ({e})") from None
    finally:
        loader.dispose()
    if problem is not None:
        raise InputFileError(source, problem)
    if finite:
        bad = nonfinite_paths(data)
        if bad:
            raise InputFileError(source, f"{bad[0]}: not a finite number (.nan and .inf are not accepted)")
    return data


def _yaml_message(e: yaml.YAMLError) -> str:
    """One line for a PyYAML error: its problem and where (PyYAML's own text adds a multi-line excerpt
    of the document, which would carry the file's bytes into the message)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None)
    if not problem:
        return printable(str(e).splitlines()[0] if str(e) else type(e).__name__)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return printable(f"{context + ': ' if context else ''}{problem}{where}")


def load_yaml(path: str | os.PathLike, root: str | os.PathLike | None = None, max_bytes: int = MAX_BYTES,
              max_depth: int = MAX_DEPTH, max_aliases: int = 0, max_nodes: int = MAX_YAML_NODES,
              finite: bool = False) -> Any:
    """Read ``path`` (:func:`read_text`) and parse it as YAML (:func:`parse_yaml`).

    Args:
        path, root, max_bytes: as :func:`read_text`.
        max_depth: deepest nesting accepted (also after expanding aliases).
        max_aliases: most alias references (``*name``); 0 refuses any.
        max_nodes: most values once every alias is expanded.
        finite: refuse ``.nan`` and ``.inf``.

    Returns:
        The parsed document (None for an empty one).

    Raises:
        InputFileError: any problem of reading or parsing, the message naming ``path``.
    """
    return parse_yaml(read_text(path, root, max_bytes), path, max_depth, max_aliases, max_nodes, finite)


# ---- printing --------------------------------------------------------------------------------------
def printable(text: Any, keep: str = "\n\t") -> str:
    """``str(text)`` with every control character escaped, for a terminal or an HTML page.

    C0 controls (except those in ``keep``), DEL, C1 controls (U+0080..U+009F, which some terminals
    read as escape sequences; U+0085 is a line break to some), lone surrogates, the bidirectional
    formatting characters (U+061C, U+200E, U+200F, U+202A..U+202E, U+2066..U+2069: they reorder what
    follows on the line, "Trojan Source") and the Unicode line and paragraph separators (U+2028,
    U+2029) become ``\\xNN`` / ``\\uNNNN``, so the text cannot move the cursor, retitle the window,
    disguise itself as other text or a new line, or smuggle a NUL into a file. Everything else is
    unchanged.
    """
    s = "" if text is None else str(text)
    pattern = _CONTROL_PATTERNS.get(keep)
    if pattern is None:
        controls = "[\\x00-\\x1f\\x7f-\\x9f\\ud800-\\udfff\\u061c\\u200e\\u200f\\u2028-\\u202e\\u2066-\\u2069]"
        pattern = re.compile(f"(?![{re.escape(keep)}]){controls}" if keep else controls)
        _CONTROL_PATTERNS[keep] = pattern
    return pattern.sub(_escape_one, s)


_CONTROL_PATTERNS: dict[str, re.Pattern[str]] = {}


def markdown_cell(text: Any) -> str:
    """``text`` as the content of one markdown table cell (or a heading or footnote line): control,
    bidi and separator characters escaped (:func:`printable`), line breaks and tabs as spaces, ``&``,
    ``<`` and ``>`` as HTML entities (a name such as ``<img src=x onerror=...>`` in a summary stays
    text in the rendered page: markdown passes raw HTML through) and ``|`` escaped (it would end the
    cell)."""
    s = printable(text, keep="\n\t").replace("\n", " ").replace("\t", " ")
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _escape_one(m: re.Match[str]) -> str:
    o = ord(m.group())
    return f"\\x{o:02x}" if o <= 0xFF else f"\\u{o:04x}"
