from crl_bench.env_api import AnswerParser, normalise_action_text

ACTIONS = ["up", "down", "left", "right"]


def test_plain_answer():
    p = AnswerParser(ACTIONS)
    assert p.parse("<answer>up</answer>").action == "up"


def test_case_and_whitespace_tolerant():
    p = AnswerParser(ACTIONS)
    assert p.parse("<ANSWER>  Left \n</Answer>").action == "left"
    assert p.parse("< answer >RIGHT< / answer >").action == "right"


def test_last_answer_wins_and_think_ignored():
    p = AnswerParser(ACTIONS)
    r = p.parse("<think>maybe <answer>up</answer>?</think> no: <answer>down</answer>")
    assert r.action == "down"


def test_open_tag_without_close_uses_rest():
    assert AnswerParser(ACTIONS).parse("<answer> left").action == "left"


def test_invalid_replies_never_raise():
    p = AnswerParser(ACTIONS)
    for reply in ["", "up", "<answer></answer>", "<answer>fly</answer>", "<answer>up down</answer>", None]:
        r = p.parse(reply)  # type: ignore[arg-type]
        assert r.action is None and not r.valid
        assert r.error


def test_error_names_valid_actions():
    r = AnswerParser(ACTIONS).parse("<answer>jump</answer>")
    assert "jump" in r.error and "up, down, left, right" in r.error


def test_aliases_and_bad_alias():
    p = AnswerParser(ACTIONS, aliases={"north": "up"})
    assert p.parse("<answer>North</answer>").action == "up"
    import pytest

    with pytest.raises(ValueError):
        AnswerParser(ACTIONS, aliases={"north": "fly"})


def test_open_action_set_and_bare():
    p = AnswerParser(None)
    assert p.parse("<answer> search[red shoes] </answer>").action == "search[red shoes]"
    assert AnswerParser(ACTIONS, allow_bare=True).parse(" Up ").action == "up"
    assert normalise_action_text("  Move   UP ") == "move up"
