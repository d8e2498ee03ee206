"""The extractor's json answer format: mapping to operations (votes included), all-or-nothing
rejection, out-of-range lesson numbers dropped as released, no length limit, garbage."""

from __future__ import annotations

import json

import pytest

from crl_bench.experience.json_ops import (
    JSON_FOLD_SYSTEM_PROMPT,
    JSON_MERGE_SYSTEM_PROMPT,
    JSON_SYSTEM_PROMPT,
    format_numbered,
    parse_json_operations,
)
from crl_bench.experience.operations import ParseResult
from crl_bench.experience.types import ExperienceEntry, Operation

SHOWN = [41, 7, 93]          # lesson 1 is bank id 41, lesson 2 is 7, lesson 3 is 93


def add(title="Push from behind", content="Stand on the far side of a box before pushing it."):
    return {"function_name": "add", "parameters": {"title": title, "content": content}}


def update(targets, title="Avoid corners", content="A box in a corner can never move again.", key="target_ids"):
    return {"function_name": "update", "parameters": {key: targets, "title": title, "content": content}}


RETURN = {"function_name": "return"}


def answer(ops, think: str = "") -> str:
    return (f"<think>{think}</think>\n" if think else "") + f"<answer>{json.dumps(ops)}</answer>"


def parse(ops, shown=SHOWN, **kw) -> ParseResult:
    return parse_json_operations(answer(ops), shown, **kw)


def test_add_update_merge_map_lesson_numbers_to_shown_ids():
    res = parse([add(), update([2]), update([3, 1], "Check walls", "Look at the map before moving.")])
    assert isinstance(res, ParseResult)
    assert res.ops == [Operation("ADD", "Push from behind", "Stand on the far side of a box before pushing it."),
                       Operation("UPDATE", "Avoid corners", "A box in a corner can never move again.", (7,)),
                       Operation("MERGE", "Check walls", "Look at the map before moving.", (93, 41))]
    assert res.errors == [] and res.ok and res.blocks == 3


@pytest.mark.parametrize("key, targets, expected", [
    ("idx", [1], ("UPDATE", (41,))),
    ("target_idx", [1, 2], ("MERGE", (41, 7))),
    ("target_ids", 3, ("UPDATE", (93,))),                 # a bare int
    ("target_ids", [2, 2], ("UPDATE", (7,))),             # two targets but one distinct lesson
    ("target_ids", [3, 1, 3], ("MERGE", (93, 41))),       # duplicates dropped, order kept
])
def test_target_aliases_and_shapes(key, targets, expected):
    res = parse([update(targets, key=key)])
    assert res.ok, res.errors
    assert [(o.kind, o.targets) for o in res.ops] == [expected]


def test_aliases_given_twice_must_agree():
    same = update([1, 2])
    same["parameters"]["idx"] = [1, 2]
    assert parse([same]).ops == [Operation("MERGE", same["parameters"]["title"], same["parameters"]["content"],
                                           (41, 7))]
    clash = update([1])
    clash["parameters"]["idx"] = [2]
    res = parse([clash])
    assert res.ops == [] and not res.ok and res.errors


def test_duplicate_shown_ids_collapse_to_update():
    assert parse([update([1, 2])], shown=[5, 5]).ops[0] == Operation(
        "UPDATE", "Avoid corners", "A box in a corner can never move again.", (5,))


def test_whitespace_collapsed_and_function_name_case():
    op = {"function_name": " ADD ", "parameters": {"title": "  Push\n from  behind ", "content": "a\tb  c"}}
    assert parse([op]).ops == [Operation("ADD", "Push from behind", "a b c")]


def test_return_first_gives_none():
    res = parse([RETURN])
    assert res.ops == [Operation("NONE")] and res.ok and res.errors == []
    # nothing after it is read, not even invalid items
    res = parse([RETURN, add(), {"function_name": "explode"}])
    assert res.ops == [Operation("NONE")] and res.ok and res.blocks == 1
    assert parse_json_operations('<answer>{"function_name": "return"}</answer>', []).ops == [Operation("NONE")]


def test_return_after_add_stops_reading():
    res = parse([add(), RETURN, update([1]), "garbage", {"function_name": "explode"}])
    assert res.ops == [Operation("ADD", "Push from behind", "Stand on the far side of a box before pushing it.")]
    assert res.ok and res.errors == [] and res.blocks == 2


def test_last_answer_block_wins_and_think_block_is_ignored():
    text = ("<think>Maybe <answer>[{\"function_name\": \"return\"}]</answer> is best</think>\n"
            + answer([add("First", "first advice")]) + "\nOn second thought:\n"
            + answer([update([1], "Second", "second advice")]) + "\n")
    res = parse_json_operations(text, SHOWN)
    assert res.ops == [Operation("UPDATE", "Second", "second advice", (41,))] and res.ok
    # an answer that only appears inside the think block is not an answer
    only_thought = "<think>I could say <answer>[{\"function_name\": \"return\"}]</answer></think> done"
    res = parse_json_operations(only_thought, SHOWN)
    assert res.ops == [] and not res.ok and res.errors
    # an unclosed leading think block is all thinking
    res = parse_json_operations("<think>hmm " + answer([add()]), SHOWN)
    assert res.ops == [] and not res.ok


def test_tag_tolerance_and_code_fence():
    body = json.dumps([add()])
    for text in (f"< ANSWER >{body}</ Answer >", f"<answer>\n```json\n{body}\n```\n</answer>",
                 f"Sure, here it is: <answer>{body}</answer> Hope it helps."):
        res = parse_json_operations(text, SHOWN)
        assert res.ok and res.ops[0].kind == "ADD", (text, res.errors)


def test_single_object_is_a_one_element_list():
    text = f"<answer>{json.dumps(update([3]))}</answer>"
    res = parse_json_operations(text, SHOWN)
    assert res.ops == [Operation("UPDATE", "Avoid corners", "A box in a corner can never move again.", (93,))]
    assert res.ok and res.blocks == 1


BAD_OPS = [
    {"function_name": "delete", "parameters": {"target_ids": [1]}},
    {"function_name": "rewrite", "parameters": {"target_ids": [1], "title": "t", "content": "c"}},
    {"function_name": "add_lesson", "parameters": {"title": "t", "content": "c"}},
    {"function_name": 3, "parameters": {"title": "t", "content": "c"}},
    {"parameters": {"title": "t", "content": "c"}},
    {"function_name": "add", "parameters": ["t", "c"]},
    {"function_name": "add"},
    "add",
    {"function_name": "add", "parameters": {"content": "c"}},
    {"function_name": "add", "parameters": {"title": "t"}},
    {"function_name": "add", "parameters": {"title": "   ", "content": "c"}},
    {"function_name": "add", "parameters": {"title": "t", "content": ""}},
    {"function_name": "add", "parameters": {"title": 5, "content": "c"}},
    {"function_name": "add", "parameters": {"title": "t", "content": ["c"]}},
    {"function_name": "upvote", "parameters": {"idx": "1"}},
    {"function_name": "downvote", "parameters": {}},
    {"function_name": "add", "parameters": {"title": "a <op> b", "content": "c"}},
    {"function_name": "add", "parameters": {"title": "t", "content": "see </content> here"}},
    {"function_name": "add", "parameters": {"title": "t", "content": "< OPS >"}},
    {"function_name": "add", "parameters": {"title": "<Title>t", "content": "c"}},
    {"function_name": "add", "parameters": {"title": "t", "content": "bad \ud800 text"}},
    {"function_name": "update", "parameters": {"title": "t", "content": "c"}},
    {"function_name": "update", "parameters": {"target_ids": [], "title": "t", "content": "c"}},
    {"function_name": "update", "parameters": {"target_ids": [1], "title": "t"}},
]


@pytest.mark.parametrize("bad", BAD_OPS)
@pytest.mark.parametrize("position", [0, 1, 2])
def test_any_invalid_operation_rejects_the_whole_reply(bad, position):
    ops = [add(), update([1, 2])]
    ops.insert(position, bad)
    res = parse(ops)
    assert res.ops == [] and not res.ok and not res.valid
    assert any(f"op {position + 1}:" in e for e in res.errors), res.errors
    assert res.blocks == 3


def test_no_length_limit_by_default_and_optional_limits_are_inclusive():
    # released: a lesson is bounded only by the token budget (a 20,000-character lesson parses)
    assert parse([add("x" * 500, "y" * 20000)]).ok
    assert parse([add("x" * 120, "y" * 600)], max_title_chars=120, max_content_chars=600).ok
    assert not parse([add("x" * 120, "y" * 600)], max_title_chars=119).valid
    assert not parse([add("x" * 20, "y" * 600)], max_content_chars=599).valid
    # the length is measured after whitespace is collapsed
    assert parse([add("x " * 60, "c")], max_title_chars=119).ok


@pytest.mark.parametrize("targets, kept", [([0], ()), ([4], ()), ([-1], ()), ([1, 4], (41,)), (4, ()),
                                           ([99999999999999999999], ()), ([3, 9, 2], (93, 7))])
def test_out_of_range_lesson_numbers_are_dropped_as_released(targets, kept):
    """Released ``_execute_functional_operations`` skips an index outside the shown lessons; an update
    left with no target deletes nothing and still adds its lesson."""
    res = parse([add(), update(targets)])
    assert res.valid and not res.ok                       # usable, with the dropped numbers noted
    assert any("out of range" in e for e in res.errors), res.errors
    second = res.ops[1]
    if not kept:
        assert second.kind == "ADD" and second.targets == ()
    else:
        assert second.targets == kept and second.kind == ("UPDATE" if len(kept) == 1 else "MERGE")


def test_votes_map_to_shown_ids_and_drop_out_of_range_numbers():
    up = {"function_name": "upvote", "parameters": {"idx": [1, 3]}}
    down = {"function_name": "downvote", "parameters": {"target_ids": [2, 9]}}
    res = parse([up, down])
    assert [(o.kind, o.targets, o.title, o.content) for o in res.ops] == [("UPVOTE", (41, 93), "", ""),
                                                                          ("DOWNVOTE", (7,), "", "")]
    assert res.valid and any("out of range" in e for e in res.errors)
    assert parse([up]).ok
    none_left = parse([{"function_name": "downvote", "parameters": {"idx": [7]}}])
    assert none_left.ops == [] and not none_left.valid      # the only vote named no shown lesson
    assert [o.kind for o in parse([{"function_name": "downvote", "parameters": {"idx": [7]}}, RETURN]).ops] == ["NONE"]
    for bad in ({"function_name": "upvote", "parameters": {}}, {"function_name": "upvote", "parameters": {"idx": []}},
                {"function_name": "downvote", "parameters": {"idx": ["1"]}}, {"function_name": "upvote"}):
        assert parse([add(), bad]).ops == []              # malformed: the whole reply is rejected


@pytest.mark.parametrize("targets", [["1"], "2", [1.0], 2.0, [True], True, [None], None, [[1]], {"1": 1}])
def test_non_integer_targets(targets):
    res = parse([update(targets)])
    assert res.ops == [] and not res.ok and res.errors


def test_update_without_shown_lessons_becomes_an_add():
    res = parse([update([1])], shown=[])
    assert [o.kind for o in res.ops] == ["ADD"] and any("out of range" in e for e in res.errors)
    assert parse([add()], shown=[]).ok


def test_too_many_ops_keeps_the_first_max_ops():
    ops = [add(f"t{i}", f"c{i}") for i in range(5)]
    res = parse(ops)
    assert [o.title for o in res.ops] == ["t0", "t1", "t2"]
    assert not res.ok and res.valid and len(res.errors) == 1 and "at most 3" in res.errors[0]
    res = parse(ops, max_ops=4)
    assert [o.title for o in res.ops] == ["t0", "t1", "t2", "t3"] and not res.ok
    exact = parse(ops[:2] + [RETURN] + ops[2:], max_ops=2)   # return ends the list before the cap
    assert [o.title for o in exact.ops] == ["t0", "t1"] and exact.ok
    # an invalid operation past the cap still rejects everything
    res = parse(ops + [{"function_name": "explode"}])
    assert res.ops == [] and not res.valid


@pytest.mark.parametrize("text", [
    "", "   \n", "<answer>", "</answer>", "<answer></answer>", "<answer>[]</answer>", "<answer>{}</answer>",
    "<answer>[1,2]</answer>", "<answer>[add]</answer>", "<answer>\"add\"</answer>", "<answer>3</answer>",
    '<answer>{"function_name": "update", "parameters": {"target_ids": [99999999999999999999]}}</answer>',
    "<answer>[" + "9" * 5000 + "]</answer>", "<answer>[1e999]</answer>", "<answer>[NaN, -Infinity]</answer>",
    "\ud800", "<answer>\ud800</answer>", '<answer>["\\ud800"]</answer>',
    "[" * 100000, "<answer>" + "[" * 100000 + "</answer>", "<answer>" + "[" * 100000 + "]" * 100000 + "</answer>",
    "<answer>" + '{"a":' * 50000 + "1" + "}" * 50000 + "</answer>",
    '<answer>[{"function_name": "update", "parameters": {"target_ids": ' + "[" * 900 + "]" * 900
    + ', "title": "t", "content": "c"}}]</answer>',
    "<answer>```" + " " * 100000 + "</answer>",
    "None", "null", "<answer>null</answer>", "<answer>None</answer>", "<answer>[null]</answer>",
    "<think>", "<think><answer>[]</answer>", "\x00<answer>\x00</answer>",
])
def test_garbage_never_raises(text):
    res = parse_json_operations(text, SHOWN)
    assert isinstance(res, ParseResult)
    assert res.ops == [] and not res.ok and res.errors


@pytest.mark.parametrize("value", [None, 3, b"<answer>[]</answer>", ["<answer>"], {"a": 1}])
def test_non_string_replies(value):
    res = parse_json_operations(value, SHOWN)  # type: ignore[arg-type]
    assert res.ops == [] and not res.ok and res.errors


def test_the_last_answer_block_is_read():
    """A thinking extractor writes the tags inside its reasoning too; the released parser reads the
    last ``<answer>`` block, and the json format generates without a stop string."""
    text = ('<think>maybe <answer>[{"function_name": "return"}]</answer>? no, better:</think>'
            + answer([add("Final", "The lesson the reply settled on, after thinking it over.")])
            + "\nsome trailing words")
    res = parse_json_operations(text, SHOWN)
    assert res.ok and [o.title for o in res.ops] == ["Final"]
    unclosed_think = 'I think <answer>[{"function_name": "return"}]</answer> then ' + answer([add()])
    assert [o.kind for o in parse_json_operations(unclosed_think, SHOWN).ops] == ["ADD"]


def test_format_numbered():
    entries = [ExperienceEntry(41, "maze", "Walls  block", "Walking into a wall\nwastes a turn."),
               ExperienceEntry(7, "maze", "Exit", "Head for the exit.")]
    assert format_numbered(entries) == "1. Walls block: Walking into a wall wastes a turn.\n2. Exit: Head for the exit."
    assert format_numbered([]) == "(none)"
    assert format_numbered([], empty="-") == "-"


def _example(prompt: str) -> str:
    return prompt[prompt.rindex("<answer>"):]


def test_system_prompt_is_a_template_and_its_example_parses():
    prompt = JSON_SYSTEM_PROMPT.format(max_ops=5)
    assert "at most 5 operations" in prompt and "{max_ops}" not in prompt
    for word in ("<think></think>", "<answer></answer>", '"function_name"', '"add"', '"update"', '"return"',
                 '"upvote"', '"downvote"', '"target_ids"', '"title"', '"content"', '[{"function_name": "return"}]',
                 "detailed", "whole"):
        assert word in prompt, word
    assert "one or two sentences" not in prompt          # the paper contract asks for detailed lessons
    res = parse_json_operations(_example(prompt), [10, 20])
    assert res.ok and [o.kind for o in res.ops] == ["ADD", "DOWNVOTE"] and res.ops[1].targets == (20,)


def test_fold_prompt_example_parses_to_lessons():
    assert "{max_ops}" not in JSON_FOLD_SYSTEM_PROMPT and "REPLACE ALL" in JSON_FOLD_SYSTEM_PROMPT
    res = parse_json_operations(_example(JSON_FOLD_SYSTEM_PROMPT), [])
    assert res.ok and [o.kind for o in res.ops] == ["ADD"]


def test_merge_prompt_example_parses_to_a_merge():
    assert "{max_ops}" not in JSON_MERGE_SYSTEM_PROMPT
    for word in ('"update"', '"return"', '"target_ids"', "<answer></answer>"):
        assert word in JSON_MERGE_SYSTEM_PROMPT, word
    res = parse_json_operations(_example(JSON_MERGE_SYSTEM_PROMPT), [10, 20, 30])
    assert res.ok and [(o.kind, o.targets) for o in res.ops] == [("MERGE", (10, 20))]
