"""Tests of the SWE-Bench-Verified tool layer (envs/swebench/tools.py): workspace, editor, parser."""

from __future__ import annotations

import json
import os

import pytest

from crl_bench.envs.swebench.tools import (
    TOOLS_PROMPT,
    LocalWorkspace,
    StrReplaceEditor,
    ToolCall,
    ToolCallError,
    ToolError,
    parse_tool_call,
)

SRC = "def f():\n    return 1\n\n\ndef g():\n    return 1\n"


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pkg").mkdir()
    (root / "pkg" / "sub").mkdir()
    (root / "pkg" / "sub" / "deep").mkdir()
    (root / "pkg" / "sub" / "deep" / "too_deep.py").write_text("x\n")
    (root / "pkg" / "sub" / "mod.py").write_text("y\n")
    (root / "pkg" / "a.py").write_text(SRC)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / "pkg" / ".hidden.py").write_text("z\n")
    (root / "README").write_text("hello\n")
    return LocalWorkspace(root, mount="/repo")


@pytest.fixture
def ed(ws):
    return StrReplaceEditor(ws)


def disk(ws, rel):
    with open(ws.root / rel, encoding="utf-8", newline="") as f:
        return f.read()


# ---------------------------------------------------------------- workspace


def test_workspace_paths(ws):
    assert ws.resolve("/repo/pkg/../pkg/a.py") == "/repo/pkg/a.py"
    assert ws.resolve("pkg/a.py") == "/repo/pkg/a.py"
    assert ws.resolve("/repo") == "/repo"
    assert ws.read("pkg/a.py") == ws.read("/repo/pkg/a.py") == SRC
    assert ws.listdir("/repo", depth=1) == ["README", "pkg/"]
    assert ws.listdir("/repo/pkg") == ["a.py", "sub/", "sub/deep/", "sub/mod.py"]


@pytest.mark.parametrize("path,msg", [
    ("/repo/../etc/passwd", "is outside the workspace; use paths under /repo"),
    ("../x", "is outside the workspace"), ("pkg/../../x", "is outside the workspace"),
    ("/etc/passwd", "is outside the workspace"), ("/repository/x", "is outside the workspace"),
    ("", "Invalid path"), ("a\x00b", "Invalid path"), ("a\ud800.py", "Cannot resolve path"),
])
def test_path_escaping_root_is_rejected(ed, ws, path, msg):
    with pytest.raises(ToolError, match=msg):
        ed.run("view", path)
    with pytest.raises(ToolError):
        ed.run("create", path, file_text="x")
    assert not (ws.root.parent / "x").exists()


def test_symlink_out_of_root_is_rejected(ed, ws, tmp_path):
    (tmp_path / "secret").write_text("s\n")
    os.symlink(tmp_path / "secret", ws.root / "link")
    with pytest.raises(ToolError, match="symbolic link"):
        ed.run("view", "/repo/link")


def test_non_utf8_file_is_a_tool_error(ed, ws):
    (ws.root / "bin.dat").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ToolError, match="not valid UTF-8"):
        ed.run("view", "/repo/bin.dat")
    with pytest.raises(ToolError, match="not valid UTF-8"):       # a lone surrogate (JSON allows "\ud800")
        ed.run("str_replace", "/repo/README", old_str="hello", new_str="\ud800")
    assert disk(ws, "README") == "hello\n"
    with pytest.raises(ToolError, match="No edit"):
        ed.run("undo_edit", "/repo/README")


def test_symlink_loop_is_tool_error(ed, ws):
    os.symlink(ws.root / "loop", ws.root / "loop")
    with pytest.raises(ToolError):
        ed.run("view", "/repo/loop")


# ---------------------------------------------------------------- view


def test_view_file_cat_n(ed):
    out = ed.run("view", "/repo/pkg/a.py")
    assert out.splitlines()[0] == "/repo/pkg/a.py, lines 1-6 of 6:"
    assert out.splitlines()[1:] == [f"{i:6}\t{line}" for i, line in enumerate(SRC.split("\n")[:-1], 1)]
    assert "     2\t    return 1" in out


def test_view_range(ed):
    out = ed.run("view", "/repo/pkg/a.py", view_range=[2, 3])
    assert out.splitlines()[1:] == ["     2\t    return 1", "     3\t"]
    assert ed.run("view", "/repo/pkg/a.py", view_range=[5, -1]).splitlines()[1:] == [
        "     5\tdef g():", "     6\t    return 1"]
    assert ed.run("view", "/repo/pkg/a.py", view_range=[6, 6]).splitlines()[1:] == ["     6\t    return 1"]


@pytest.mark.parametrize("rng", [[0, 2], [3, 2], [1, 7], [7, -1], [-1, -1], [2, -2]])
def test_view_invalid_range(ed, rng):
    with pytest.raises(ToolError, match="Invalid view_range"):
        ed.run("view", "/repo/pkg/a.py", view_range=rng)


def test_view_range_type_and_directory(ed):
    with pytest.raises(ToolError, match="two integers"):
        ed.run("view", "/repo/pkg/a.py", view_range=[1])
    with pytest.raises(ToolError, match="only be used when viewing a file"):
        ed.run("view", "/repo/pkg", view_range=[1, 2])


def test_view_directory_two_levels_no_hidden(ed):
    out = ed.run("view", "/repo")
    lines = out.splitlines()[1:]                          # after the header
    assert lines[0] == "/repo/"
    assert "/repo/pkg/a.py" in lines and "/repo/pkg/sub/" in lines and "/repo/README" in lines
    assert not any(".git" in x or ".hidden" in x for x in lines)
    assert not any("mod.py" in x or "deep" in x for x in lines)   # third level
    assert "/repo/pkg/sub/mod.py" in ed.run("view", "pkg").splitlines()


def test_view_empty_and_missing(ed, ws):
    (ws.root / "empty.py").write_text("")
    assert "is empty" in ed.run("view", "/repo/empty.py")
    with pytest.raises(ToolError, match="is empty"):
        ed.run("view", "/repo/empty.py", view_range=[1, 1])
    with pytest.raises(ToolError, match="does not exist"):
        ed.run("view", "/repo/nope.py")


def test_truncation(ws):
    (ws.root / "big.py").write_text("".join(f"line number {i}\n" for i in range(1000)))
    ed = StrReplaceEditor(ws, max_output_chars=500)
    out = ed.run("view", "/repo/big.py")
    body, marker = out.rsplit("\n", 1)
    assert len(body) <= 500 and marker.startswith("<output truncated:") and "view_range" in marker
    assert body.splitlines()[-1].endswith(str(len(body.splitlines()) - 2))   # cut at a line boundary
    assert "truncated" not in StrReplaceEditor(ws).run("view", "/repo/big.py", view_range=[1, 10])


def test_tabs_are_preserved_not_expanded(ed, ws):
    (ws.root / "Makefile").write_text("all:\n\techo hi\n\techo bye\n")
    assert "     2\t\techo hi" in ed.run("view", "/repo/Makefile")
    ed.run("str_replace", "/repo/Makefile", old_str="\techo bye", new_str="\techo ciao")
    assert disk(ws, "Makefile") == "all:\n\techo hi\n\techo ciao\n"
    with pytest.raises(ToolError, match="did not appear verbatim"):
        ed.run("str_replace", "/repo/Makefile", old_str="        echo hi", new_str="x")


# ---------------------------------------------------------------- create


def test_create_makes_parents(ed, ws):
    out = ed.run("create", "/repo/new/dir/f.py", file_text="a\nb")
    assert "Created /repo/new/dir/f.py" in out
    assert disk(ws, "new/dir/f.py") == "a\nb"          # no newline added


def test_create_over_existing_is_error(ed, ws):
    with pytest.raises(ToolError, match="already exists as a file.*str_replace"):
        ed.run("create", "/repo/pkg/a.py", file_text="boom")
    with pytest.raises(ToolError, match="already exists as a directory"):
        ed.run("create", "/repo/pkg", file_text="boom")
    assert disk(ws, "pkg/a.py") == SRC
    with pytest.raises(ToolError, match="missing required argument.*file_text"):
        ed.run("create", "/repo/c.py")


def test_create_under_a_file_is_tool_error(ed):
    with pytest.raises(ToolError, match="Cannot access"):
        ed.run("create", "/repo/README/x.py", file_text="x")


# ---------------------------------------------------------------- str_replace


def test_str_replace_unique(ed, ws):
    out = ed.run("str_replace", "/repo/pkg/a.py", old_str="def g():\n    return 1",
                 new_str="def g():\n    return 2")
    assert disk(ws, "pkg/a.py") == SRC.replace("return 1\n", "return 2\n").replace("return 2", "return 1", 1)
    assert "     6\t    return 2" in out and "     2\t    return 1" in out   # snippet with context


def test_str_replace_snippet_shows_context_around_edit(ws):
    (ws.root / "long.txt").write_text("".join(f"l{i}\n" for i in range(1, 21)))
    out = StrReplaceEditor(ws, snippet_context=2).run("str_replace", "/repo/long.txt", old_str="l10\n",
                                                      new_str="A\nB\nC\n")
    assert [x for x in out.splitlines() if "\t" in x] == [
        "     8\tl8", "     9\tl9", "    10\tA", "    11\tB", "    12\tC", "    13\tl11", "    14\tl12"]
    out = StrReplaceEditor(ws, snippet_context=1).run("insert", "long.txt", insert_line=3, new_str="X\nY")
    assert [x for x in out.splitlines() if "\t" in x] == ["     3\tl3", "     4\tX", "     5\tY",
                                                          "     6\tl4"]


def test_str_replace_delete_default_new_str(ed, ws):
    ed.run("str_replace", "/repo/README", old_str="hello")
    assert disk(ws, "README") == "\n"


def test_str_replace_missing(ed, ws):
    with pytest.raises(ToolError, match="did not appear verbatim"):
        ed.run("str_replace", "/repo/pkg/a.py", old_str="return 3")
    with pytest.raises(ToolError, match="must not be empty"):
        ed.run("str_replace", "/repo/pkg/a.py", old_str="")
    assert disk(ws, "pkg/a.py") == SRC


def test_str_replace_ambiguous_reports_lines(ed, ws):
    with pytest.raises(ToolError, match=r"occurs 2 times .* lines 2, 6;"):
        ed.run("str_replace", "/repo/pkg/a.py", old_str="    return 1", new_str="    return 0")
    (ws.root / "o.txt").write_text("aaa\n")
    with pytest.raises(ToolError, match="occurs 2 times"):        # overlapping occurrences count too
        ed.run("str_replace", "/repo/o.txt", old_str="aa", new_str="b")
    assert disk(ws, "pkg/a.py") == SRC


def test_crlf_and_no_final_newline_preserved(ed, ws):
    (ws.root / "w.txt").write_bytes(b"one\r\ntwo\r\nthree")
    ed.run("str_replace", "/repo/w.txt", old_str="two", new_str="2")
    assert (ws.root / "w.txt").read_bytes() == b"one\r\n2\r\nthree"


# ---------------------------------------------------------------- insert


def test_insert_top_middle_end(ed, ws):
    (ws.root / "i.txt").write_text("a\nb\n")
    ed.run("insert", "/repo/i.txt", insert_line=0, new_str="top")
    assert disk(ws, "i.txt") == "top\na\nb\n"
    out = ed.run("insert", "/repo/i.txt", insert_line=2, new_str="mid1\nmid2\n")
    assert disk(ws, "i.txt") == "top\na\nmid1\nmid2\nb\n"
    assert "     3\tmid1" in out and "     4\tmid2" in out
    ed.run("insert", "/repo/i.txt", insert_line=5, new_str="end")
    assert disk(ws, "i.txt") == "top\na\nmid1\nmid2\nb\nend\n"


def test_insert_end_without_final_newline(ed, ws):
    (ws.root / "n.txt").write_text("a\nb")
    ed.run("insert", "/repo/n.txt", insert_line=2, new_str="c")
    assert disk(ws, "n.txt") == "a\nb\nc"
    (ws.root / "e.txt").write_text("")
    ed.run("insert", "/repo/e.txt", insert_line=0, new_str="first\n")
    assert disk(ws, "e.txt") == "first\n"


@pytest.mark.parametrize("line", [-1, 3, "7"])
def test_insert_out_of_range(ed, ws, line):
    (ws.root / "i.txt").write_text("a\nb\n")
    with pytest.raises(ToolError, match="Invalid insert_line"):
        ed.run("insert", "/repo/i.txt", insert_line=line, new_str="x")
    assert disk(ws, "i.txt") == "a\nb\n"


def test_insert_type_errors(ed):
    with pytest.raises(ToolError, match="insert_line must be an integer"):
        ed.run("insert", "/repo/README", insert_line="one", new_str="x")
    with pytest.raises(ToolError, match="missing required argument.*new_str"):
        ed.run("insert", "/repo/README", insert_line=1)


# ---------------------------------------------------------------- undo_edit


def test_undo_each_kind(ed, ws):
    ed.run("str_replace", "/repo/pkg/a.py", old_str="def f", new_str="def h")
    ed.run("insert", "/repo/pkg/a.py", insert_line=0, new_str="import os")
    assert disk(ws, "pkg/a.py") == "import os\n" + SRC.replace("def f", "def h")
    out = ed.run("undo_edit", "/repo/pkg/a.py")
    assert disk(ws, "pkg/a.py") == SRC.replace("def f", "def h") and "     1\tdef h():" in out
    ed.run("undo_edit", "pkg/a.py")                       # same file, relative path
    assert disk(ws, "pkg/a.py") == SRC
    with pytest.raises(ToolError, match="No edit of /repo/pkg/a.py to undo"):
        ed.run("undo_edit", "/repo/pkg/a.py")
    ed.run("create", "/repo/c.py", file_text="c\n")
    assert "no longer exists" in ed.run("undo_edit", "/repo/c.py")
    assert not (ws.root / "c.py").exists()


def test_undo_empty_history(ed):
    with pytest.raises(ToolError, match="No edit of /repo/README to undo"):
        ed.run("undo_edit", "/repo/README")


def test_failed_edit_is_not_recorded(ed, ws):
    with pytest.raises(ToolError):
        ed.run("str_replace", "/repo/README", old_str="absent")
    with pytest.raises(ToolError, match="No edit"):
        ed.run("undo_edit", "/repo/README")


# ---------------------------------------------------------------- bad editor input


@pytest.mark.parametrize("cmd,args,msg", [
    ("str_replace", {"old_str": "a"}, "is a directory"),
    ("insert", {"insert_line": 0, "new_str": "a"}, "is a directory"),
    ("view", {"view_range": [1, 2]}, "only be used when viewing a file"),
])
def test_directory_given_to_file_command(ed, cmd, args, msg):
    with pytest.raises(ToolError, match=msg):
        ed.run(cmd, "/repo/pkg", **args)


@pytest.mark.parametrize("cmd,args,msg", [
    ("delete", {}, "unknown command 'delete'"),
    ("str_replace", {"new_str": "x"}, "missing required argument.*old_str"),
    ("view", {"file_text": "x"}, "unknown argument.*file_text"),
    ("str_replace", {"old_str": 3}, "old_str must be a string"),
    ("str_replace", {"old_str": "nope"}, "does not exist"),
    ("insert", {"insert_line": 0, "new_str": "x"}, "does not exist"),
])
def test_bad_editor_input_is_tool_error(ed, cmd, args, msg):
    with pytest.raises(ToolError, match=msg):
        ed.run(cmd, "/repo/missing.py", **args)


# ---------------------------------------------------------------- parser


def call(name, arguments=None, **extra):
    obj = {"name": name, **({} if arguments is None else {"arguments": arguments}), **extra}
    return f"<tool_call>{json.dumps(obj)}</tool_call>"


def ed_call(**arguments):
    return call("str_replace_editor", arguments)


def test_parse_each_tool():
    assert parse_tool_call("Let me look.\n" + call("bash", {"command": "ls -la"})) == ToolCall(
        "bash", {"command": "ls -la"})
    assert parse_tool_call(call("submit", {})) == ToolCall("submit", {})
    assert parse_tool_call(call("submit")) == ToolCall("submit", {})
    v = parse_tool_call(ed_call(command="view", path="/repo/a.py", view_range=[1, -1]))
    assert v == ToolCall("str_replace_editor", {"command": "view", "path": "/repo/a.py",
                                                "view_range": [1, -1]})
    r = parse_tool_call(call("str_replace_editor", {"command": "str_replace", "path": "/r", "old_str": "a"}))
    assert r.args == {"command": "str_replace", "path": "/r", "old_str": "a"}
    i = parse_tool_call(ed_call(command="insert", path="/r", insert_line="3", new_str="x"))
    assert i.args["insert_line"] == 3
    c = parse_tool_call(call("str_replace_editor", {"command": "create", "path": "/r", "file_text": ""}))
    assert c.args["file_text"] == ""
    u = parse_tool_call(call("str_replace_editor", {"command": "undo_edit", "path": "/r"}))
    assert u.args == {"command": "undo_edit", "path": "/r"}


def test_parse_tolerates_whitespace_fence_and_string_arguments():
    body = '{"name": "bash", "arguments": {"command": "pwd"}}'
    expected = ToolCall("bash", {"command": "pwd"})
    assert parse_tool_call(f"<tool_call>\n  {body}\n</tool_call>") == expected
    assert parse_tool_call(f"<tool_call>\n```json\n{body}\n```\n</tool_call>") == expected
    assert parse_tool_call(f"<tool_call>```{body}```</tool_call>") == expected
    assert parse_tool_call(call("bash", json.dumps({"command": "pwd"}))) == expected
    view = parse_tool_call(call("str_replace_editor", {"command": "view", "path": "/r", "view_range": None}))
    assert view.args == {"command": "view", "path": "/r"}


def test_parse_tag_mentioned_before_the_block():
    text = "I will now emit a <tool_call> block: " + call("bash", {"command": "ls"})
    assert parse_tool_call(text) == ToolCall("bash", {"command": "ls"})


def test_parse_several_blocks_last_wins():
    text = call("bash", {"command": "ls"}) + " then " + call("submit", {})
    assert parse_tool_call(text).name == "submit"
    assert parse_tool_call(call("submit") + call("bash", {"command": "ls"})).name == "bash"


@pytest.mark.parametrize("text,msg", [
    ("I will run ls", "no <tool_call> block"),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "unterminated"),
    ("<tool_call>{name: bash}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>', "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", 'string "name"'),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),
    (call("python", {"code": "1"}), "Unknown tool 'python'"),
    (call("bash", {}), "missing required argument.*command"),
    (call("bash", {"command": "ls", "timeout": 5}), "unknown argument.*timeout"),
    (call("bash", {"command": "   "}), "command is empty"),
    (call("bash", {"command": ["ls"]}), "command must be a string"),
    (call("bash", [1]), '"arguments" must be a JSON object'),
    (call("bash", "not json"), "does not hold a JSON object"),
    (call("submit", {"answer": "x"}), "unknown argument.*answer"),
    (call("bash", {"command": "ls"}, id=3), "Unexpected key"),
    (call("str_replace_editor", {"command": "view"}), "missing required argument.*path"),
    (call("str_replace_editor", {"command": "rm", "path": "/r"}), "unknown command 'rm'"),
    (call("str_replace_editor", {"path": "/r"}), "unknown command None"),
    (call("str_replace_editor", {"command": "view", "path": "/r", "view_range": [1, "5"]}), "two integers"),
    (call("str_replace_editor", {"command": "view", "path": "/r", "view_range": [1, 2, 3]}), "two integers"),
    (call("str_replace_editor", {"command": "view", "path": "/r", "view_range": [True, 2]}), "two integers"),
    (ed_call(command="insert", path="/r", insert_line=1.5, new_str="x"), "insert_line must be an integer"),
    (ed_call(command="insert", path="/r", insert_line="two", new_str="x"), "insert_line must be an integer"),
    (call("str_replace_editor", {"command": "insert", "path": "/r", "new_str": "x"}), "missing.*insert_line"),
    (call("str_replace_editor", {"command": "create", "path": "/r", "old_str": "x", "file_text": ""}),
     "unknown argument.*old_str"),
    (call("str_replace_editor", {"command": "create", "path": 5, "file_text": ""}), "path must be a string"),
])
def test_parse_errors(text, msg):
    with pytest.raises(ToolCallError, match=msg) as e:
        parse_tool_call(text)
    assert "<tool_call>" in str(e.value) and "str_replace_editor" in str(e.value)   # format restated


def test_parsed_call_runs_on_editor(ed, ws):
    c = parse_tool_call(ed_call(command="insert", path="/repo/README", insert_line="1", new_str="world"))
    ed.run(**c.args)
    assert disk(ws, "README") == "hello\nworld\n"


def test_tools_prompt_mentions_every_tool_and_command():
    for word in ("<tool_call>", "bash", "str_replace_editor", "submit", "view", "create", "str_replace",
                 "insert", "undo_edit", "view_range", "insert_line", "old_str", "new_str", "file_text"):
        assert word in TOOLS_PROMPT
    assert issubclass(ToolCallError, ToolError)
