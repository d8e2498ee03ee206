"""Agent tools of the SWE-Bench-Verified environment: file editor, workspace layer, tool-call parser.

The actor acts through three tools: ``bash`` (a shell command, run by the environment in the task's
container), ``str_replace_editor`` (view / create / edit files: :class:`StrReplaceEditor` on a
:class:`Workspace`) and ``submit`` (end the episode).  Nothing here needs Docker: :class:`LocalWorkspace`
is a local directory; a container-backed workspace implements the same protocol.

Tool-call format (ours).  A reply calls one tool with a block (text around it is free; if there are
several blocks the last one is used)::

    <tool_call>{"name": "str_replace_editor", "arguments": {"command": "view", "path": "/repo"}}</tool_call>

holding one JSON object; ``arguments`` is an object (it may be omitted when empty, or be a string holding
the object); whitespace and a ```` ```json ```` fence inside the tags are tolerated.  ``bash`` takes
``command`` (str, not blank); ``str_replace_editor`` takes ``command``, ``path`` and the command's
arguments (:data:`EDITOR_COMMANDS`; ``view_range`` a list of 2 ints, ``insert_line`` an int or a string
of digits, the others strings); ``submit`` takes none.  Unknown tools, missing or unknown arguments and
wrong types raise :class:`ToolCallError`, whose message restates the format; optional arguments given as
``null`` count as absent.

Editor decisions.  Files are read and written as UTF-8 with line endings and the presence or absence of
a final newline preserved exactly; tabs are *not* expanded (``view`` shows, and ``old_str`` must match,
the file's own text, so tab-indented files such as Makefiles are never rewritten).  ``create`` makes
missing parent directories and refuses to overwrite an existing file.  Each edit (create, str_replace,
insert) pushes the file's previous state on a per-file stack that ``undo_edit`` pops (undoing a create
removes the file).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class ToolError(Exception):
    """Invalid tool use (bad argument, missing file, ambiguous edit...); the message is shown to the agent."""


class ToolCallError(ToolError):
    """The actor's reply does not hold a well-formed tool call; the message restates the expected format."""


class Workspace(Protocol):
    """File access for the editor.  Paths are the agent's: absolute inside the workspace or relative to its
    root.  Every method raises :class:`ToolError` (never another exception) for a path outside the
    workspace or an I/O error.

    * ``resolve(path)``: the canonical absolute path as the agent sees it (used in messages, undo keys).
    * ``read(path)``: the whole text of a UTF-8 file, line endings untouched (ToolError if not text).
    * ``write(path, text)``: write ``text`` exactly, creating parent directories.
    * ``remove(path)``: delete a file.
    * ``exists(path)``, ``is_dir(path)``: whether the path exists / is a directory.
    * ``listdir(path, depth=2)``: sorted non-hidden entries below the directory ``path`` down to ``depth``
      levels, as paths relative to it, directories ending with ``/``; hidden ones are not descended into.
    """

    def resolve(self, path: str) -> str: ...
    def read(self, path: str) -> str: ...
    def write(self, path: str, text: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def exists(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def listdir(self, path: str, depth: int = 2) -> list[str]: ...


class LocalWorkspace:
    """A :class:`Workspace` on a local directory that the agent sees mounted at ``mount``.

    Args:
        root: the local directory (must exist).
        mount: the absolute path the agent uses for ``root`` (``/repo/x.py`` is ``root/x.py``).

    Raises:
        ValueError: ``root`` is not a directory or ``mount`` is not absolute.
    """

    def __init__(self, root: str | os.PathLike, mount: str = "/repo"):
        self.root = Path(root).resolve()
        if not self.root.is_dir() or not mount.startswith("/"):
            raise ValueError(f"need an existing root directory and an absolute mount: {root!r}, {mount!r}")
        self.mount = posixpath.normpath(mount)

    def _local(self, path: str) -> tuple[Path, str]:
        """(local path, canonical agent path) of ``path``; ToolError if invalid or outside the root."""
        if not isinstance(path, str) or not path.strip() or "\x00" in path:
            raise ToolError(f"Invalid path {path!r}: expected a non-empty string.")
        norm = posixpath.normpath(path.strip())
        rel = posixpath.relpath(norm, self.mount) if norm.startswith("/") else norm
        if rel == ".." or rel.startswith("../"):
            raise ToolError(f"Path {path!r} is outside the workspace; use paths under {self.mount}.")
        try:
            local = (self.root / rel).resolve()     # follows symlinks: they may not lead out either
        except (OSError, RuntimeError, ValueError):  # a symlink loop (3.11: RuntimeError), lone surrogates
            raise ToolError(f"Cannot resolve path {path!r}.") from None
        if local != self.root and self.root not in local.parents:
            raise ToolError(f"Path {path!r} leads outside the workspace (through a symbolic link).")
        return local, posixpath.normpath(posixpath.join(self.mount, rel))

    def resolve(self, path: str) -> str:
        """See :meth:`Workspace.resolve`."""
        return self._local(path)[1]

    def _do(self, path: str, op: Callable[[Path], Any]) -> Any:
        """``op(local path)``, its decoding and OS errors turned into ToolError."""
        local, shown = self._local(path)
        try:
            return op(local)
        except UnicodeError:                        # a file that is not UTF-8, or text with lone surrogates
            raise ToolError(f"{shown}: not valid UTF-8 text.") from None
        except OSError as e:
            raise ToolError(f"Cannot access {shown}: {e.strerror or e}.") from None

    def read(self, path: str) -> str:
        """See :meth:`Workspace.read`."""
        return self._do(path, lambda local: local.read_bytes().decode("utf-8"))   # keeps \r\n as is

    def write(self, path: str, text: str) -> None:
        """See :meth:`Workspace.write`."""
        self._do(path, lambda local: _write_text(local, text))

    def remove(self, path: str) -> None:
        """See :meth:`Workspace.remove`."""
        self._do(path, Path.unlink)

    def exists(self, path: str) -> bool:
        """See :meth:`Workspace.exists`."""
        return self._do(path, Path.exists)

    def is_dir(self, path: str) -> bool:
        """See :meth:`Workspace.is_dir`."""
        return self._do(path, Path.is_dir)

    def listdir(self, path: str, depth: int = 2) -> list[str]:
        """See :meth:`Workspace.listdir` (symbolic links to directories are listed, not followed)."""
        return self._do(path, lambda local: _walk(str(local), depth))


def _write_text(local: Path, text: str) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(text.encode("utf-8"))


def _walk(directory: str, depth: int, prefix: str = "") -> list[str]:
    out = []
    for e in sorted(os.scandir(directory), key=lambda e: e.name):
        if not e.name.startswith("."):
            is_dir = e.is_dir(follow_symlinks=False)
            out.append(prefix + e.name + ("/" if is_dir else ""))
            if is_dir and depth > 1:
                out += _walk(e.path, depth - 1, f"{prefix}{e.name}/")
    return out


# ------------------------------------------------------------------ argument specs (editor and parser)

#: ``str_replace_editor`` commands -> (required arguments, optional arguments), ``command``/``path`` aside.
EDITOR_COMMANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "view": ((), ("view_range",)),
    "create": (("file_text",), ()),
    "str_replace": (("old_str",), ("new_str",)),
    "insert": (("insert_line", "new_str"), ()),
    "undo_edit": ((), ()),
}


def _coerce(name: str, value: Any) -> Any:
    """Check (and normalise) one argument's type: ``view_range`` a list of 2 ints, ``insert_line`` an int
    or a string of digits, everything else a string.  Raises ToolError."""
    if name == "view_range":
        if (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            return list(value)
        raise ToolError(f"view_range must be a list of two integers [start, end], got {value!r}.")
    if name == "insert_line":
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ToolError(f"insert_line must be an integer, got {value!r}.")
    if not isinstance(value, str):
        raise ToolError(f"{name} must be a string, got {type(value).__name__}.")
    return value


def _check_args(tool: str, required: tuple[str, ...], optional: tuple[str, ...], args: dict) -> dict:
    """Validate ``args`` against a spec (null optional arguments are dropped); return them coerced."""
    args = {k: v for k, v in args.items() if not (v is None and k in optional)}
    if missing := [k for k in required if k not in args]:
        raise ToolError(f"{tool}: missing required argument(s): {', '.join(missing)}.")
    if extra := sorted(set(args) - set(required) - set(optional)):
        allowed = ", ".join(required + optional) or "none"
        raise ToolError(f"{tool}: unknown argument(s): {', '.join(extra)} (allowed: {allowed}).")
    return {k: _coerce(k, v) for k, v in args.items()}


def check_editor_args(args: dict) -> dict:
    """Validate all arguments of a ``str_replace_editor`` call (``command``, ``path`` and the command's own).

    Returns the arguments with types normalised (``insert_line`` an int, ``view_range`` a list); raises
    ToolError for an unknown command, a missing or unknown argument or a wrong type.
    """
    command = args.get("command")
    if command not in EDITOR_COMMANDS:
        raise ToolError(f"str_replace_editor: unknown command {command!r}; use one of: "
                        f"{', '.join(EDITOR_COMMANDS)}.")
    required, optional = EDITOR_COMMANDS[command]
    return _check_args(f"str_replace_editor {command}", ("command", "path") + required, optional, args)


# ------------------------------------------------------------------ the editor

def _lines(text: str) -> list[str]:
    """Lines of ``text`` split on ``\\n`` only, without a trailing empty piece for a final newline."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def _span(new_str: str) -> int:
    """How many lines an inserted text reaches below the line where it starts."""
    return max(0, len(_lines(new_str)) - 1)


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, first))


@dataclass
class StrReplaceEditor:
    """The ``str_replace_editor`` tool on a :class:`Workspace` (see the module docstring for its decisions).

    Args:
        workspace: where files live.
        max_output_chars: longer outputs are cut at a line boundary and end with a truncation marker.
        snippet_context: lines shown around an edit on either side.
    """

    workspace: Workspace
    max_output_chars: int = 16000
    snippet_context: int = 4
    _history: dict[str, list[str | None]] = field(default_factory=dict, init=False, repr=False)

    def run(self, command: str, path: str, **args: Any) -> str:
        """Run one editor command.

        Args:
            command: ``view``, ``create``, ``str_replace``, ``insert`` or ``undo_edit``.
            path: the file or directory (absolute inside the workspace, or relative to its root).
            **args: the command's arguments (see :data:`EDITOR_COMMANDS`).

        Returns:
            the text shown to the agent (at most ``max_output_chars`` plus the truncation marker).

        Raises:
            ToolError: any invalid use (bad arguments, missing path, directory given to a file command,
                old_str absent or ambiguous, line out of range, nothing to undo, path outside the workspace).
        """
        a = check_editor_args({"command": command, "path": path, **args})
        handler: Callable[..., str] = getattr(self, "_" + a.pop("command"))
        return self._truncate(handler(self.workspace.resolve(a.pop("path")), **a))

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        cut = text.rfind("\n", 0, self.max_output_chars)
        cut = cut if cut > 0 else self.max_output_chars
        return (text[:cut] + f"\n<output truncated: {cut} of {len(text)} characters shown; "
                "view a smaller part (view_range, or a subdirectory)>")

    def _file(self, path: str) -> str:
        """Text of an existing regular file, else ToolError."""
        if not self.workspace.exists(path):
            raise ToolError(f"{path} does not exist.")
        if self.workspace.is_dir(path):
            raise ToolError(f"{path} is a directory; this command needs a file.")
        return self.workspace.read(path)

    def _save(self, path: str, old: str | None, new: str) -> None:
        self.workspace.write(path, new)
        self._history.setdefault(path, []).append(old)

    def _snippet(self, path: str, text: str, first: int, last: int) -> str:
        lines = _lines(text)
        if not lines:
            return f"Edited {path}; the file is now empty."
        lo, hi = max(1, first - self.snippet_context), min(len(lines), last + self.snippet_context)
        return (f"Edited {path}. Lines {lo}-{hi} now read:\n{_numbered(lines[lo - 1:hi], lo)}\n"
                "Check that the change is what you intended (undo_edit reverts it).")

    def _view(self, path: str, view_range: list[int] | None = None) -> str:
        if self.workspace.exists(path) and self.workspace.is_dir(path):
            if view_range is not None:
                raise ToolError("view_range can only be used when viewing a file, not a directory.")
            entries = "\n".join(posixpath.join(path, e) for e in self.workspace.listdir(path, 2))
            return f"Entries in {path}, 2 levels deep, hidden ones excluded:\n{path}/\n{entries}"
        lines = _lines(self._file(path))
        n = len(lines)
        start, end = view_range if view_range is not None else (1, n)
        if view_range is not None:
            if n == 0:
                raise ToolError(f"{path} is empty; view it without view_range.")
            if not 1 <= start <= n or not (end == -1 or start <= end <= n):
                raise ToolError(f"Invalid view_range {view_range}: {path} has {n} lines; use 1 <= start <= "
                                f"{n} and start <= end <= {n}, or end = -1 for the end of the file.")
            end = n if end == -1 else end
        if n == 0:
            return f"{path} is empty."
        return f"{path}, lines {start}-{end} of {n}:\n{_numbered(lines[start - 1:end], start)}"

    def _create(self, path: str, file_text: str) -> str:
        if self.workspace.exists(path):
            kind = "a directory" if self.workspace.is_dir(path) else "a file"
            raise ToolError(f"{path} already exists as {kind}; edit files with str_replace or insert.")
        self._save(path, None, file_text)
        return f"Created {path} ({len(_lines(file_text))} lines)."

    def _str_replace(self, path: str, old_str: str, new_str: str = "") -> str:
        text = self._file(path)
        if not old_str:
            raise ToolError("old_str must not be empty.")
        starts = [m.start() for m in re.finditer(f"(?={re.escape(old_str)})", text)]
        if not starts:
            raise ToolError(f"No change made: old_str did not appear verbatim in {path} "
                            "(check whitespace and indentation, e.g. with view).")
        if len(starts) > 1:
            where = ", ".join(str(text.count("\n", 0, s) + 1) for s in starts)
            raise ToolError(f"No change made: old_str occurs {len(starts)} times in {path}, starting at "
                            f"lines {where}; include more surrounding lines so that it is unique.")
        new = text[:starts[0]] + new_str + text[starts[0] + len(old_str):]
        self._save(path, text, new)
        first = text.count("\n", 0, starts[0]) + 1
        return self._snippet(path, new, first, first + _span(new_str))

    def _insert(self, path: str, insert_line: int, new_str: str) -> str:
        text = self._file(path)
        lines = _lines(text)
        if not 0 <= insert_line <= len(lines):
            raise ToolError(f"Invalid insert_line {insert_line}: {path} has {len(lines)} lines; use 0 "
                            f"(top of the file) to {len(lines)} (after the last line).")
        if insert_line == len(lines):                       # append; keep the file's final-newline state
            sep = "\n" if text and not text.endswith("\n") else ""
            tail = "\n" if text.endswith("\n") and not new_str.endswith("\n") else ""
            new = text + sep + new_str + tail
        else:
            offset = sum(len(line) + 1 for line in lines[:insert_line])
            new = text[:offset] + new_str + ("" if new_str.endswith("\n") else "\n") + text[offset:]
        self._save(path, text, new)
        return self._snippet(path, new, insert_line + 1, insert_line + 1 + _span(new_str))

    def _undo_edit(self, path: str) -> str:
        stack = self._history.get(path)
        if not stack:
            raise ToolError(f"No edit of {path} to undo.")
        old = stack.pop()
        if old is None:
            self.workspace.remove(path)
            return f"Undid the creation of {path}; the file no longer exists."
        self.workspace.write(path, old)
        lines = _lines(old)
        return f"Undid the last edit of {path}. It now reads:\n{_numbered(lines, 1) if lines else '(empty)'}"


# ------------------------------------------------------------------ tool-call parsing

TOOLS_PROMPT = """\
You act through tools.  Each reply must end with exactly one tool call written as
<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>
with a JSON object inside the tags.  You may think in plain text before the call.  Tools:

- bash: run a shell command in the repository's environment and see its output.
  arguments: {"command": "<shell command>"}
- str_replace_editor: look at and edit files (paths absolute, e.g. /repo/pkg/module.py).
  {"command": "view", "path": P, "view_range": [start, end]}   file with line numbers (view_range optional,
      1-based, end -1 = to the end of the file) or a directory listing 2 levels deep
  {"command": "create", "path": P, "file_text": TEXT}          new file (fails if it already exists)
  {"command": "str_replace", "path": P, "old_str": OLD, "new_str": NEW}
      replace OLD, which must occur exactly once and match the file verbatim (spaces and tabs included)
  {"command": "insert", "path": P, "insert_line": N, "new_str": TEXT}   insert after line N (0 = top)
  {"command": "undo_edit", "path": P}                           revert your last edit of P
- submit: finish when the issue is fixed; your changes to the repository are your answer.
  arguments: {}

Example: <tool_call>{"name": "bash", "arguments": {"command": "grep -rn 'def parse' /repo"}}</tool_call>"""

#: Argument specs of the tools other than the editor (whose spec is :data:`EDITOR_COMMANDS`).
TOOL_ARGS: dict[str, tuple[tuple[str, ...], ...]] = {"bash": (("command",), ()), "submit": ((), ())}
TOOL_NAMES = ("bash", "str_replace_editor", "submit")
_FORMAT = ('Expected exactly one tool call such as <tool_call>{"name": "bash", "arguments": '
           f'{{"command": "ls"}}}}</tool_call>; tools: {", ".join(TOOL_NAMES)}.')
_BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.S)   # innermost opening tag
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: ``name`` in :data:`TOOL_NAMES` and its validated ``args``."""

    name: str
    args: dict[str, Any]


def parse_tool_call(text: str) -> ToolCall:
    """Extract and validate the tool call of an actor reply (format in the module docstring).

    Args:
        text: the actor's whole reply.

    Returns:
        the :class:`ToolCall` of the last ``<tool_call>`` block, its arguments type-checked and normalised
        (for ``str_replace_editor``, ``insert_line`` is an int).

    Raises:
        ToolCallError: no complete block, invalid JSON, unknown tool, missing/unknown argument or wrong
            type; the message says what is wrong and restates the expected format.
    """
    try:
        blocks = _BLOCK.findall(text)
        if not blocks:
            missing = "an unterminated <tool_call> block" if "<tool_call>" in text else "no <tool_call> block"
            raise ToolCallError(f"Your reply has {missing}.")
        body = blocks[-1].strip()
        if fence := _FENCE.fullmatch(body):
            body = fence.group(1)
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ToolCallError(f"The tool call is not valid JSON ({e}).") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError('The tool call must be a JSON object with a string "name".')
        if extra := sorted(set(obj) - {"name", "arguments"}):
            raise ToolCallError(f'Unexpected key(s) {", ".join(extra)}: use only "name" and "arguments".')
        name, args = obj["name"], obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise ToolCallError('"arguments" is a string that does not hold a JSON object.') from None
        if not isinstance(args, dict):
            raise ToolCallError('"arguments" must be a JSON object.')
        if name == "str_replace_editor":
            return ToolCall(name, check_editor_args(args))
        if name not in TOOL_ARGS:
            raise ToolCallError(f"Unknown tool {name!r}.")
        args = _check_args(name, *TOOL_ARGS[name], args)
        if name == "bash" and not args["command"].strip():
            raise ToolCallError("bash: command is empty.")
        return ToolCall(name, args)
    except ToolError as e:                      # ours, and argument errors from the shared checks
        raise ToolCallError(f"{e}\n{_FORMAT}") from None
