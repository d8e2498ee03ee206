"""The extractor's operation format: round trip, malformed replies, limits, tolerance."""

from __future__ import annotations

import pytest

from crl_bench.experience.operations import ParseResult, format_entries, format_operations, parse_operations
from crl_bench.experience.types import ExperienceEntry, Operation

OPS = [
    Operation("ADD", "Push from behind", "Stand on the far side of a box before pushing it."),
    Operation("UPDATE", "Avoid corners", "A box in a corner can never move again.", (12,)),
    Operation("MERGE", "Check walls", "Look at the map before moving; walls waste turns.", (3, 7)),
]


def test_round_trip():
    text = format_operations(OPS)
    assert text.startswith("<ops>\n") and text.endswith("\n</ops>")
    res = parse_operations(text)
    assert isinstance(res, ParseResult)
    assert res.ops == OPS and res.errors == [] and res.ok and res.blocks == 3
    none = parse_operations(format_operations([Operation("NONE")]))
    assert none.ops == [Operation("NONE")] and none.ok
    assert format_operations([]) == "<ops>\n<op>NONE</op>\n</ops>"
    # unwrapped and without the closing tag (a reply that ended on EOS)
    assert parse_operations(format_operations(OPS, wrap=False)).ops == OPS
    assert parse_operations("<ops>\n" + format_operations(OPS, wrap=False)).ok


def test_whitespace_and_case_tolerance():
    text = ("  < OPS >\n< op > add </ OP >  <Title> Push  from\t behind </title> "
            "<CONTENT>Stand on the far side.</content>  \n\n"
            "<op>update #12</op><content>c</content><title>t</title>\n"
            "<op>Merge 3, 7</op><title>m</title><content>x</content>\n"
            "<op>refine [5]</op><title>r</title><content>y</content>\n</Ops>")
    res = parse_operations(text)
    assert res.errors == [] and res.ok
    assert res.ops == [Operation("ADD", "Push from behind", "Stand on the far side."),
                       Operation("UPDATE", "t", "c", (12,)), Operation("MERGE", "m", "x", (3, 7)),
                       Operation("UPDATE", "r", "y", (5,))]


def test_think_block_is_skipped_and_text_after_close_ignored():
    res = parse_operations("<think>ADD? no, <op>NONE</op> maybe</think>\n" + format_operations(OPS[:1])
                           + "\ntrailing words")
    assert res.ops == OPS[:1] and res.ok


def test_line_break_closes_content_and_later_lines_are_stray():
    res = parse_operations("<ops>\n<op>ADD</op><title>a</title><content>b c\n</ops>")
    assert res.ops == [Operation("ADD", "a", "b c")] and res.ok
    res = parse_operations("<ops>\n<op>ADD</op><title>a</title><content>b c</ops>")
    assert res.ops == [Operation("ADD", "a", "b c")] and res.ok
    assert not parse_operations("<ops>\n<op>ADD</op><title>a</title><content>b c").valid   # cut by the cap
    res = parse_operations("<op>ADD</op><title>a</title><content>b c\n##_P_#\nYou are at row 2\n"
                           "<op>UPDATE 3</op><title>t</title><content>u</content>")
    assert res.ops == [Operation("ADD", "a", "b c"), Operation("UPDATE", "t", "u", (3,))]
    assert not res.ok and len(res.errors) == 1 and "stray text after" in res.errors[0]
    # a content spread over lines ends at the first line break; the rest is stray
    res = parse_operations("<op>ADD</op><title>a</title><content>first\nsecond</content>")
    assert res.ops == [Operation("ADD", "a", "first")] and not res.ok
    # several operations on one line are fine
    res = parse_operations("<op>NONE</op>")
    assert res.ok
    two = "<op>ADD</op><title>a</title><content>b</content><op>ADD</op><title>c</title><content>d</content>"
    assert parse_operations(two).ok and len(parse_operations(two).ops) == 2


@pytest.mark.parametrize("text, fragment", [
    ("<op>ADD</op><title>a\nb</title><content>c</content>", "<title> is not closed"),
    ("<op>ADD\n</op><title>a</title><content>c</content>", "not closed by </op>"),
    ("", "empty reply"),
    ("   \n ", "empty reply"),
    ("I think the agent should push boxes.", "no <op> block"),
    ("<op>DELETE 3</op><title>a</title><content>b</content>", "unknown operation kind"),
    ("<op>ADD</op><content>b</content>", "<title> is missing"),
    ("<op>ADD</op><title>a</title>", "<content> is missing"),
    ("<op>ADD</op><title>a</title><content>b and then the reply was cut", "<content> is not closed"),
    ("<op>ADD</op><title> </title><content>b</content>", "empty <title>"),
    ("<op>UPDATE x</op><title>a</title><content>b</content>", "not an integer"),
    ("<op>UPDATE 1.5</op><title>a</title><content>b</content>", "not an integer"),
    ("<op>UPDATE</op><title>a</title><content>b</content>", "exactly one entry id"),
    ("<op>UPDATE 1 2</op><title>a</title><content>b</content>", "exactly one entry id"),
    ("<op>MERGE 4</op><title>a</title><content>b</content>", "at least two distinct"),
    ("<op>MERGE 4 4</op><title>a</title><content>b</content>", "at least two distinct"),
    ("<op>ADD 3</op><title>a</title><content>b</content>", "ADD takes no entry id"),
    ("<op>NONE 3</op>", "NONE takes no entry id"),
    ("<op>NONE</op><title>a</title><content>b</content>", "NONE takes no title"),
    ("<op>ADD<title>a</title><content>b</content>", "not closed by </op>"),
    ("<op></op><title>a</title><content>b</content>", "empty <op></op> header"),
    ("<op>ADD</op><title>a</title><title>c</title><content>b</content>", "more than one <title>"),
    ("{\"op\": \"ADD\", \"title\": \"a\"}", "no <op> block"),
    ("<ops></ops>", "no <op> block"),
])
def test_malformed_reply_gives_errors_not_exceptions(text, fragment):
    res = parse_operations(text)
    assert res.ops == [] and not res.ok
    assert any(fragment in e for e in res.errors), res.errors


def test_bad_block_is_skipped_and_good_ones_kept():
    text = ("<ops>\n<op>ADD</op><title>a</title>\n"          # no content: skipped
            "<op>UPDATE 2</op><title>b</title><content>c</content>\n</ops>")
    res = parse_operations(text)
    assert res.ops == [Operation("UPDATE", "b", "c", (2,))]
    assert len(res.errors) == 1 and not res.ok and res.valid


def test_stray_text_keeps_the_operation_but_is_not_ok():
    res = parse_operations("Sure! Here you go:\n<op>ADD</op><title>a</title><content>b</content> thanks")
    assert res.ops == [Operation("ADD", "a", "b")]
    assert len(res.errors) == 2 and not res.ok


def test_none_with_other_operations_is_dropped():
    text = "<op>NONE</op>\n" + format_operations(OPS[:1], wrap=False)
    res = parse_operations(text)
    assert res.ops == OPS[:1] and not res.ok and any("NONE" in e for e in res.errors)
    res = parse_operations("<op>NONE</op><op>none</op>")
    assert res.ops == [Operation("NONE")] and not res.ok


def test_max_ops():
    five = [Operation("ADD", f"t{i}", f"c{i}") for i in range(5)]
    res = parse_operations(format_operations(five), max_ops=4)
    assert res.ops == five[:4] and not res.ok and any("at most 4" in e for e in res.errors)
    assert parse_operations(format_operations(five), max_ops=5).ok
    assert parse_operations(format_operations(five[:1]), max_ops=1).ok


def test_known_ids_and_length_limits():
    res = parse_operations(format_operations(OPS), known_ids=[12])
    assert res.ops == OPS[:2] and any("unknown entry id" in e for e in res.errors)
    long = format_operations([Operation("ADD", "t", "x" * 50)])
    assert parse_operations(long, max_content_chars=49).ops == []
    assert parse_operations(long, max_title_chars=0).ops == []


def test_non_string_input_does_not_raise():
    assert parse_operations(None).errors == ["empty reply"]  # type: ignore[arg-type]


def test_format_rejects_tags_inside_fields():
    with pytest.raises(ValueError):
        format_operations([Operation("ADD", "a</title>", "b")])
    with pytest.raises(ValueError):
        format_operations([Operation("DELETE", "a", "b")])


def test_entries_and_guidance():
    entries = [ExperienceEntry(12, "sokoban", "Avoid corners", "A box in a corner\n is stuck."),
               ExperienceEntry(3, "sokoban", "Walls", "Bumping wastes a move.")]
    assert format_entries(entries) == ("[12] Avoid corners: A box in a corner is stuck.\n"
                                       "[3] Walls: Bumping wastes a move.")
    assert format_entries([]) == "(none)"


def test_votes_round_trip_and_rules():
    """UPVOTE / DOWNVOTE (released ``upvote`` / ``downvote``): one or more ids, no title or content."""
    votes = [Operation("UPVOTE", targets=(4,)), Operation("DOWNVOTE", targets=(9, 2))]
    text = format_operations(votes)
    assert "<op>UPVOTE 4</op>" in text and "<op>DOWNVOTE 9 2</op>" in text
    res = parse_operations(text)
    assert res.ops == votes and res.ok
    assert parse_operations("<op>upvote #4, [4]</op>").ops == [Operation("UPVOTE", targets=(4,))]   # de-duplicated
    for bad, why in [("<op>UPVOTE</op>", "at least one entry id"),
                     ("<op>DOWNVOTE 3</op><title>t</title><content>c</content>", "no title or content"),
                     ("<op>UPVOTE x</op>", "not an integer")]:
        res = parse_operations(bad)
        assert res.ops == [] and any(why in e for e in res.errors), (bad, res.errors)
    res = parse_operations(text, known_ids=[4])
    assert res.ops == votes[:1] and any("unknown entry id" in e for e in res.errors)


def test_no_length_limit_by_default():
    long = format_operations([Operation("ADD", "t" * 300, "x" * 5000)])
    assert parse_operations(long).ok


def test_entry_ids_beyond_the_largest_are_an_error_not_a_crash():
    """A reply naming an id of 5,000 digits (past Python's int-conversion limit) or one past SQLite's
    largest integer gets the operation's error; the largest id itself still parses."""
    from crl_bench.experience.operations import MAX_ENTRY_ID

    for big in ("9" * 5000, str(MAX_ENTRY_ID + 1)):
        res = parse_operations(f"<ops><op>UPVOTE 3 {big}</op></ops>")
        assert res.ops == [] and "beyond the largest entry id" in res.errors[0]
    res = parse_operations(f"<ops><op>UPVOTE {MAX_ENTRY_ID}</op></ops>")
    assert res.ops[0].targets == (MAX_ENTRY_ID,)
