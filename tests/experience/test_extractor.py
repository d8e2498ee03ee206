"""Experience extractor: trajectory compaction, prompt, rewards, and sampling with a tiny model."""

from __future__ import annotations

import pytest

from crl_bench.env_api import feedback_of
from crl_bench.experience.extractor import (
    DEFAULT_SAMPLING,
    EpisodeRecord,
    Extraction,
    Extractor,
    ExtractorPromptBuilder,
    compact_trajectory,
    strip_observation,
)
from crl_bench.experience.types import ExperienceEntry
from crl_bench.llm.base import SamplingParams
from crl_bench.trainer.advantages import grouped_advantages
from crl_bench.trainer.extractor_training import (
    binary_reward,
    extraction_sample,
    relative_reward,
)

MAP = "Map (row 0 is the top):\n######\n#P_X_#\n#__O_#\n######\nLegend: # wall, _ floor\nValid actions: up, down"


def _record(n: int, long_obs: bool = False) -> EpisodeRecord:
    actions = ["up", "left", "down", "right"]
    steps = []
    for i in range(n):
        obs = f"{MAP}\nYou are at step {i}." + (" filler" * 400 if long_obs else "")
        steps.append((obs, actions[i % 4] if 0 < i < n - 1 else f"special{i}", f"feedback {i % 3}"))
    return EpisodeRecord("sokoban", "Push the box onto the target.", steps, success=False, reward=0.0,
                         final_obs=MAP + "\nYou are at the end.", group_id=3, source=("ep", 7))


def _n(tok, text):
    return len(tok.encode(text, add_special_tokens=False))


def test_short_episode_is_shown_in_full(tokenizer):
    rec = _record(3)
    text = compact_trajectory(rec, tokenizer, 2000)
    assert text.startswith("Start:\n" + MAP)
    for i in range(3):
        assert f"Step {i + 1}: " in text
    assert "Before step 2:" in text and "Before step 3:" in text and "After the last step:" in text
    assert "omitted" not in text


@pytest.mark.parametrize("budget", [60, 120])
def test_compaction_at_tiny_budgets_keeps_the_last_step(tokenizer, budget):
    text = compact_trajectory(_record(30), tokenizer, budget)
    assert _n(tokenizer, text) <= budget
    assert text.startswith("Start:\nMap") and text.endswith("Step 30: special29 -> feedback 2")


@pytest.mark.parametrize("budget", [200, 400, 800])
def test_compaction_respects_budget_and_keeps_first_and_last(tokenizer, budget):
    rec = _record(30)
    text = compact_trajectory(rec, tokenizer, budget)
    assert _n(tokenizer, text) <= budget
    assert "Start:" in text and "You are at step 0." in text           # first observation
    assert "Step 1: special0" in text and "Step 30: special29" in text  # first and last steps
    if _n(tokenizer, compact_trajectory(rec, tokenizer, 10**6)) > budget:
        assert "omitted" in text and "Actions:" in text                 # middle summarised


def test_long_observations_are_cut(tokenizer):
    rec = _record(12, long_obs=True)
    text = compact_trajectory(rec, tokenizer, 300)
    assert _n(tokenizer, text) <= 300
    assert "Step 12: special11" in text and "(cut)" in text


def test_tiny_budget_and_empty_episode(tokenizer):
    assert _n(tokenizer, compact_trajectory(_record(30, long_obs=True), tokenizer, 10)) <= 10
    assert compact_trajectory(_record(5), tokenizer, 0) == ""
    empty = EpisodeRecord("sokoban", "task", [], final_obs="just a map")
    assert "No action was taken" in compact_trajectory(empty, tokenizer, 100)


def test_summary_counts_actions():
    import crl_bench.experience.transcripts as x

    line = x._summary([("o", "up", "hit"), ("o", "up", "hit"), ("o", "left", "")], 2, 4)
    assert line.startswith("... steps 2-4 omitted (3 steps). Actions: up x2, left x1.")
    assert '"hit" x2' in line


def test_feedback_and_strip_helpers():
    obs = "Map\n##\nLast: You bumped into a wall.\nValid actions: up, down"
    assert feedback_of(obs) == "You bumped into a wall."
    assert feedback_of("Invalid action: 'x'.\nMap") == "Invalid action: 'x'."
    assert feedback_of("Map\n##") == ""
    assert strip_observation(obs) == "Map\n##"


ENTRIES = [ExperienceEntry(12, "sokoban", "Avoid corners", "A box in a corner is stuck."),
           ExperienceEntry(40, "sokoban", "Walls", "Bumping into walls wastes moves.")]


def test_prompt_builds_with_ids_and_fits(tokenizer):
    b = ExtractorPromptBuilder(tokenizer, max_prompt_tokens=1024)
    rec = _record(30)
    ids = b.build(rec, ENTRIES)
    assert len(ids) <= 1024
    text = tokenizer.decode(ids)
    assert "[12] Avoid corners: A box in a corner is stuck." in text and "[40] Walls:" in text
    assert "Push the box onto the target." in text and "failure (reward 0.00) after 30 steps" in text
    assert text.endswith("<|im_start|>assistant\n<ops>\n<op>")          # generation prompt + prefill
    assert "Valid actions:" not in text.split("Game: sokoban")[1]       # default observation hook
    plain = ExtractorPromptBuilder(tokenizer, max_prompt_tokens=1024, prefill="", demo=False)
    t2 = tokenizer.decode(plain.build(rec, []))
    assert t2.endswith("<|im_start|>assistant\n") and "(none)" in t2 and "Game: maze" not in t2


def test_prompt_drops_entries_when_too_long(tokenizer):
    many = [ExperienceEntry(i, "sokoban", f"t{i}", "word " * 60) for i in range(20)]
    b = ExtractorPromptBuilder(tokenizer, max_prompt_tokens=1200)
    ids, shown, traj = b.prepare(_record(30), many)
    assert len(ids) <= 1200 and 0 < len(shown) < 20 and shown == many[:len(shown)]
    assert _n(tokenizer, traj) >= b.min_trajectory_tokens - 1


def test_relative_and_binary_rewards():
    assert relative_reward(1.0, [0.0, 1.0]) == 1.0
    assert relative_reward(0.5, [0.0, 1.0]) == 0.0
    assert relative_reward(0.0, [0.0, 1.0]) == -1.0
    assert relative_reward(1.0, [1.0, 1.0, 1.0]) == 0.0
    with pytest.raises(ValueError):
        relative_reward(1.0, [])
    # the released live reward: the guided episode's score, a score of 0 counting -1
    assert binary_reward(1.0) == 1.0 and binary_reward(0.0) == -1.0
    assert binary_reward(0.4) == 0.4 and binary_reward(-1.0) == -1.0


def test_extractor_batch_advantages_are_one_group():
    """The extractor's advantages: rewards against the batch mean (one group for the whole batch)."""
    def batch(rewards, std=False):
        return grouped_advantages(rewards, [0] * len(rewards), std_normalize=std)
    assert batch([]) == []
    assert batch([1.0, 0.0, -1.0, 0.0]) == [1.0, 0.0, -1.0, 0.0]
    assert batch([1.0, 1.0, 0.0, 0.0]) == [0.5, 0.5, -0.5, -0.5]
    assert batch([1.0, 1.0, 0.0, 0.0], std=True) == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-5)
    assert batch([2.0, 2.0], std=True) == [0.0, 0.0]


class _FakeEngine:
    """Returns canned replies (to test parsing of good and garbage outputs deterministically)."""

    def __init__(self, tokenizer, replies):
        self.tokenizer = tokenizer
        self.replies = replies
        self.calls = 0

    def generate(self, prompts, params, allowed=None):
        from crl_bench.llm.base import Generation

        self.calls += 1
        out = []
        for p, r in zip(prompts, self.replies):
            r, reason = r if isinstance(r, tuple) else (r, "stop")
            ids = self.tokenizer.encode(r, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-1.0] * len(ids), r, reason))
        return out


def test_eos_ends_the_line_but_the_token_cap_does_not(tokenizer):
    reply = "ADD</op><title>Plan</title><content>Plan pushes."
    eng = _FakeEngine(tokenizer, [(reply, "eos"), (reply, "length"), ("ADD</op><title>P</title><content>Q\n", "stop")])
    extractor = Extractor(eng, tokenizer, ExtractorPromptBuilder(tokenizer, max_prompt_tokens=800))
    out = extractor.extract([_record(3)] * 3, [[]] * 3)
    assert out[0].parse.ok and out[0].parse.ops[0].content == "Plan pushes."
    assert not out[1].parse.valid and out[1].finish_reason == "length"
    assert out[2].parse.ok
    assert out[0].text == "<ops>\n<op>" + reply                        # text as generated (no added line break)


def test_extract_parses_with_prefill_and_shown_ids(tokenizer):
    replies = ["ADD</op><title>Plan</title><content>Plan pushes.</content>\n</ops>",
               "UPDATE 12</op><title>Corners</title><content>Never corner a box.</content>\n"
               "<op>UPDATE 99</op><title>x</title><content>y</content>\n</ops>",
               "banana split </ops>"]
    eng = _FakeEngine(tokenizer, replies)
    extractor = Extractor(eng, tokenizer, ExtractorPromptBuilder(tokenizer, max_prompt_tokens=1024),
                          DEFAULT_SAMPLING, extractor_version=5)
    out = extractor.extract([_record(4), _record(6), _record(2)], [[], ENTRIES, ENTRIES[:1]])
    assert eng.calls == 1 and len(out) == 3
    assert out[0].parse.ok and out[0].parse.ops[0].kind == "ADD"
    assert out[0].text.startswith("<ops>\n<op>ADD</op>")
    assert out[1].parse.ops[0].targets == (12,) and len(out[1].parse.ops) == 1
    assert any("unknown entry id" in e for e in out[1].parse.errors)     # 99 was not shown
    assert out[1].shown_ids == [12, 40]
    assert out[2].parse.ops == [] and out[2].parse.errors
    assert all(e.extractor_version == 5 and e.group_id == 3 and e.source_episode == ("ep", 7) for e in out)
    assert len({e.id for e in out}) == 3 and all(e.reward is None for e in out)
    sample = extraction_sample(out[0], 0.5)
    assert sample.response_ids == out[0].response_ids and sample.old_logprobs == out[0].logprobs
    assert sample.advantage == 0.5 and sample.prompt_ids == out[0].prompt_ids


def test_extract_with_tiny_model(tokenizer, tiny_model):
    from crl_bench.llm.hf_engine import HFEngine

    eng = HFEngine(tiny_model, tokenizer, batch_size=4)
    b = ExtractorPromptBuilder(tokenizer, max_prompt_tokens=700)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, stop=("</ops>",))
    extractor = Extractor(eng, tokenizer, b, sampling)
    recs = [_record(3), _record(20)]
    out = extractor.extract(recs, [ENTRIES, []])
    assert len(out) == 2 and all(isinstance(e, Extraction) for e in out)
    for e, _rec in zip(out, recs):
        assert 1 <= len(e.response_ids) <= 12
        assert len(e.logprobs) == len(e.response_ids) and all(lp <= 0.0 for lp in e.logprobs)
        assert len(e.prompt_ids) <= 700 and e.env_id == "sokoban"
        assert e.text.startswith("<ops>\n<op>")
        assert e.parse.errors and not e.parse.ok     # random weights: garbage, reported, no crash
    assert extractor.extract([], []) == []
    with pytest.raises(ValueError):
        extractor.extract(recs, [[]])
