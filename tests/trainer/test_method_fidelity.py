"""Complementary RL as the paper and its released code do it (docs/method.md): extractor reward per
call, bounded buffers, the extractor's own tokenizer, the actor-critic gate, the JSON extractor format,
the multi-turn prompt, flushing before rollouts and the paper preset."""

import copy
import threading

import pytest
from tests_helpers import CoinEnv, coin_config

from crl_bench.config import build_config, preset_data
from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.extractor import Extraction
from crl_bench.experience.types import ExperienceEntry, RetrievalRecord
from crl_bench.llm.base import Generation
from crl_bench.rollout import EpisodeSpec, PromptBuilder, Trajectory
from crl_bench.trainer.actor_critic import parse_judgement
from crl_bench.trainer.extractor_training import critic_reward, use_reward
from crl_bench.trainer.loop import Trainer

ADD = "<op>ADD</op><title>Call heads</title><content>Heads wins the coin toss.</content>"


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


class Scripted:
    """An engine that answers every prompt with ``text`` (token ids from the real tokenizer)."""

    def __init__(self, tokenizer, text, strip_prefix=""):
        self.tokenizer = tokenizer
        self.text = text
        self.strip_prefix = strip_prefix
        self.prompts = []

    def generate(self, prompts, params, allowed=None):
        self.prompts += [list(p) for p in prompts]
        text = self.text[len(self.strip_prefix):] if self.text.startswith(self.strip_prefix) else self.text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [Generation(list(p), ids, [-1.0] * len(ids), text, "stop") for p in prompts]

    def sync_weights(self, model):
        pass


def _cfg(method="complementary", **extra):
    return coin_config(method, **extra)


def _trainer(tokenizer, model, method="complementary", extractor_text=ADD, **extra):
    tr = Trainer(_cfg(method, **extra), model=model, tokenizer=tokenizer, embedder=HashEmbedder(64),
                 extractor_model=copy.deepcopy(model))
    extractor = tr.experience.extractor
    extractor.engine = Scripted(tokenizer, ("<ops>\n" + extractor_text + "\n</ops>") if "<op>" in extractor_text
                                else extractor_text, extractor.prompts.prefill)
    return tr


def _guided(success, reward, entries, judgement="", group=0):
    t = Trajectory("test-coin", 1, group, "guided", reward=reward, success=success)
    t.retrieval = RetrievalRecord(entries, "shown", judgement)
    t.experience_ids = [e.id for e in entries]
    return t


def _extraction(eid):
    return Extraction(eid, "test-coin", [1, 2], [3, 4], [-1.0, -1.0], "", None)


# ---- extractor reward: one sample per extraction call, mean over its uses ------------------------

def test_extractor_reward_is_the_mean_over_uses_of_one_call(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, extractor={"batch_size": 2})
    track = tr.experience
    for eid in ("A", "B"):
        track.waiting_reward[eid] = _extraction(eid)
    ea, eb = ExperienceEntry(1, "test-coin", "a", "x", source_extraction="A"), \
        ExperienceEntry(2, "test-coin", "b", "y", source_extraction="B")
    free = Trajectory("test-coin", 1, 0, "free", reward=0.0)
    # A guided three episodes: success, failure, success -> (1 - 1 + 1) / 3; B one failure -> -1
    trajs = [free, _guided(True, 1.0, [ea]), _guided(False, 0.0, [ea]), _guided(True, 1.0, [ea, eb]),
             _guided(False, 0.0, [eb])]
    track.after_rollout(trajs, step=5)
    assert not track.waiting_reward                  # A and B wrote no entry that is in the bank: forgotten now
    assert track.buffer["A"].uses == 3 and track.buffer["A"].reward == pytest.approx(1 / 3)
    assert track.buffer["B"].uses == 2 and track.buffer["B"].reward == pytest.approx(0.0)
    # the update takes one sample per call
    up = track.maybe_update_extractor()
    assert up is not None and up["extractor_batch"] == 2          # one sample per call, not per use
    assert up["extractor_reward_mean"] == pytest.approx((1 / 3 + 0.0) / 2)
    assert up["extractor_uses_mean"] == pytest.approx(2.5)
    assert not track.buffer
    tr.close()


def test_relative_reward_option_and_partial_scores(tokenizer, tiny_model):
    e = ExperienceEntry(1, "test-coin", "a", "x", source_extraction="A")
    assert use_reward(_guided(False, 0.4, [e]), [0.0, 1.0], "binary") == pytest.approx(0.4)
    assert use_reward(_guided(False, 0.0, [e]), [0.0, 1.0], "binary") == -1.0
    assert use_reward(_guided(True, 1.0, [e]), [0.0, 1.0], "relative") == 1.0
    assert use_reward(_guided(False, 0.5, [e]), [0.0, 1.0], "relative") == 0.0
    assert use_reward(_guided(False, 0.0, [e]), [], "relative") == -1.0      # no free baseline


def test_static_buffer_is_bounded(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, method="static", extractor={"batch_size": 3})
    track = tr.experience
    entries = [ExperienceEntry(n + 1, "test-coin", "t", "c", source_extraction=f"x{n}") for n in range(20)]
    for _ in range(3):
        for e in entries:       # (these entries are not in the bank, so each step forgets their writers)
            track.waiting_reward[e.source_extraction] = _extraction(e.source_extraction)
        track.after_rollout([_guided(True, 1.0, [e]) for e in entries], step=9)
        assert len(track.buffer) <= 3
    assert track.maybe_update_extractor() is None                  # frozen
    assert list(track.buffer) == ["x17", "x18", "x19"] and track.dropped == 57
    tr.close()


# ---- the actor-critic gate ---------------------------------------------------------------------

def test_parse_judgement_and_reward_mapping():
    assert parse_judgement('x <answer>{"function_name": "accept", "parameters": {}}</answer>', "orig").guidance \
        == "orig"
    j = parse_judgement('<answer>{"function_name": "refine", "parameters": {"knowledge": " go  north "}}</answer>',
                        "orig")
    assert (j.decision, j.guidance) == ("refine", "go north")
    assert parse_judgement('<answer>{"function_name": "reject"}</answer>', "orig").decision == "reject"
    for bad in ("", "<answer>nope</answer>", '<answer>{"function_name": "refine", "parameters": {}}</answer>',
                '<answer>{"function_name": "maybe"}</answer>', '<answer>[1]</answer>', "<answer>" + "[" * 5000,
                '<answer>{"function_name": "accept", "parameters": 3}</answer>'):
        assert parse_judgement(bad, "orig").decision == "invalid"
    # the last answer wins
    assert parse_judgement('<answer>{"function_name": "reject"}</answer> then '
                           '<answer>{"function_name": "accept"}</answer>', "o").decision == "accept"
    assert critic_reward("reject", 1.0) == -1.0 and critic_reward("refine", 0.0) == 0.5
    assert critic_reward("accept", 0.0) == 1.0 and critic_reward("accept", 1.0) == 2.0
    assert critic_reward("invalid", 0.0) == 0.0
    e = ExperienceEntry(1, "test-coin", "a", "x", source_extraction="A")
    # accept with a failed episode: 0 + 1 = 1 (the 0 -> -1 rule comes after and does not apply)
    assert use_reward(_guided(False, 0.0, [e], "accept"), [], "binary") == 1.0
    assert use_reward(_guided(True, 1.0, [e], "reject"), [], "binary") == -1.0
    assert use_reward(_guided(False, 0.0, [e], "invalid"), [], "binary") == -1.0


class StopAtStrings(Scripted):
    """:class:`Scripted`, cut as an engine cuts a reply: at the first of the sampling's stop strings."""

    def generate(self, prompts, params, allowed=None):
        text = self.text
        for stop in params.stop:
            if stop in text:
                text = text[:text.index(stop) + len(stop)]
        self.prompts += [list(p) for p in prompts]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [Generation(list(p), ids, [-1.0] * len(ids), text, "stop") for p in prompts]


@pytest.mark.parametrize("training", [True, False])
def test_the_judges_last_answer_decides_as_released(tokenizer, tiny_model, training):
    """A judgement that answers twice is read by its last answer, in training and in evaluation: the
    released judge generates with the actor's generating args (no ``</answer>`` stop) and parses the
    last ``<answer>`` (``memory_integration_mixin.py`` ``actor_critic``, ``_parse_actor_critic_response``)."""
    tr = _trainer(tokenizer, tiny_model, experience={"actor_critic": True})
    tr.train_step()                                                    # the warm-up writes a lesson
    tr.experience.critic.engine = StopAtStrings(
        tokenizer, '<answer>{"function_name": "reject", "parameters": {}}</answer> On reflection: '
                   '<answer>{"function_name": "accept", "parameters": {}}</answer>')
    if training:
        records = [t.retrieval for t in tr.train_step().trajectories if t.subgroup == "guided"]
    else:                                                    # the evaluation's guide, eval sampling
        task = tr.evaluator.task_ids(1)["test-coin"][0]
        records = [g.record for g in tr.experience.eval_guide(
            [("test-coin", "Call the coin.", tr.evaluator.first_query("test-coin", task))])]
    assert records and all(r is not None and r.entries for r in records)
    assert [r.judgement for r in records] == ["accept"] * len(records)
    tr.close()


@pytest.mark.parametrize("decision,shown", [("accept", "Heads wins"), ("refine", "Always say heads."),
                                            ("reject", None)])
def test_actor_critic_gate_decides_what_is_shown(tokenizer, tiny_model, decision, shown):
    tr = _trainer(tokenizer, tiny_model, experience={"actor_critic": True})
    params = '{"knowledge": "Always say heads."}' if decision == "refine" else "{}"
    tr.experience.critic.engine = Scripted(
        tokenizer, f'<answer>{{"function_name": "{decision}", "parameters": {params}}}</answer>')
    tr.train_step()
    res = tr.train_step()
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    assert guided and all(t.experience_ids for t in guided)       # the entries stay credited
    for t in guided:
        assert t.retrieval.judgement == decision
        text = tokenizer.decode(t.turns[0].prompt_ids)
        if shown is None:
            assert t.guidance == "" and "Heads wins" not in text
        else:
            assert shown in t.guidance and shown in text
    assert res.metrics[f"critic_{decision}"] == len(guided)
    outcomes = sum(e.times_success + e.times_failure for e in tr.experience.bank.entries())
    assert outcomes == (0 if shown is None else len(guided))      # only experience the actor saw is scored
    expected = {"accept": lambda t: t.reward + 1.0, "refine": lambda t: 0.5, "reject": lambda t: -1.0}[decision]
    rewards = [u["extractor_reward_mean"] for u in tr.experience.updates]
    waiting = [c.reward for c in tr.experience.buffer.values()]
    assert rewards or waiting
    # every use got the gate's reward: accept = score + 1 (so 1 or 2), refine 0.5, reject -1
    uses = [(c.total, c.uses) for c in tr.experience.buffer.values()]
    assert uses or rewards
    if decision == "accept":
        want = sum(expected(t) for t in guided) / len(guided)
        ups = tr.experience.updates
        total = sum(t for t, _ in uses) + sum(
            u["extractor_reward_mean"] * u["extractor_batch"] * u["extractor_uses_mean"] for u in ups)
        n = sum(k for _, k in uses) + sum(u["extractor_batch"] * u["extractor_uses_mean"] for u in ups)
        assert n == len(guided) and total / n == pytest.approx(want)
    else:
        assert all(r == pytest.approx(expected(None)) for r in rewards + waiting)
    tr.close()


# ---- the extractor's own model and tokenizer ------------------------------------------------------

def test_extractor_with_its_own_tokenizer(tokenizer, tiny_model, tmp_path):
    """A different vocabulary (here: '<ops>' and '<op>' as added tokens) is allowed, and extractor
    prompts are tokenised with the extractor's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.add_tokens(["<ops>", "<op>"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ext")
    tok.save_pretrained(tmp_path / "ext")
    tr = Trainer(_cfg(extractor={"model": str(tmp_path / "ext")}), model=tiny_model, tokenizer=tokenizer,
                 embedder=HashEmbedder(64))
    track = tr.experience
    assert len(track.tokenizer) == len(tokenizer) + 2
    ops_id = track.tokenizer.convert_tokens_to_ids("<ops>")
    assert ops_id >= len(tokenizer)
    real = track.extractor.engine
    track.extractor.engine = Scripted(track.tokenizer, "<ops>\n" + ADD + "\n</ops>", track.extractor.prompts.prefill)
    tr.train_step()
    prompt = track.extractor.engine.prompts[0]
    assert ops_id in prompt and max(prompt) < len(track.tokenizer)
    assert track.updater.pad_id == track.tokenizer.pad_token_id
    assert real.tokenizer is track.tokenizer
    tr.close()


# ---- the JSON extractor format -------------------------------------------------------------------

def test_json_format_end_to_end(tokenizer, tiny_model):
    reply = ('<think>one lesson</think><answer>[{"function_name": "add", "parameters": '
             '{"title": "Call heads", "content": "Heads wins the coin toss."}}]</answer>')
    tr = _trainer(tokenizer, tiny_model, extractor_text=reply, extractor={"format": "json"})
    assert tr.experience.extractor.sampling.stop == ()       # released: no stop, the last <answer> is read
    m = tr.train_step().metrics
    assert m["bank_size"] >= 1 and m["extractions_parsed"] == 4
    prompt = tokenizer.decode(tr.experience.extractor.engine.prompts[0])
    assert '"function_name"' in prompt and "at most 3 operations" in prompt
    # the guided episode of step 2 shows the lesson; its extractor sees it numbered 1 and may update it
    tr.experience.extractor.engine.text = ('<answer>[{"function_name": "update", "parameters": {"target_ids": [1], '
                                           '"title": "Heads", "content": "Say heads every time."}}]</answer>')
    tr.train_step()
    assert any(e.content == "Say heads every time." for e in tr.experience.bank.entries())
    tr.close()


# ---- prompts: the released multi-turn layout and system placement ---------------------------------

def test_multiturn_prompt_extends_the_previous_turn(tokenizer, tiny_model):
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.rollout import EnvPool, Guidance, RolloutRunner

    pb = PromptBuilder(tokenizer, "<answer>", history=2, layout="multiturn", placement="system")
    runner = RolloutRunner(HFEngine(tiny_model, tokenizer), pb, EnvPool(max_steps=3),
                           SamplingParams(temperature=1.0, max_new_tokens=8), True)

    def guide(requests):
        return [Guidance("LESSON: go north.", [7], None) for _ in requests]

    trajs = runner.collect([EpisodeSpec("sokoban", 3, retrieve=True)], guide=guide)
    turns = trajs[0].turns
    assert len(turns) >= 2
    texts = [tokenizer.decode(t.prompt_ids) for t in turns]
    for k in range(1, len(turns)):
        prev = texts[k - 1][:-len("<answer>")]
        assert texts[k].startswith(prev)                       # append-only: the history is kept whole
        assert turns[k - 1].reply in texts[k]
        assert texts[k].count("LESSON: go north.") == 1        # knowledge once, in the system prompt
    assert texts[-1].index("LESSON") < texts[-1].index("<|im_start|>user")
    with pytest.raises(ValueError):
        PromptBuilder(tokenizer, layout="sliding")


def test_window_layout_with_user_placement_repeats_the_guidance(tokenizer):
    pb = PromptBuilder(tokenizer, layout="window", placement="user")
    chat = []
    ids = pb.turn(chat, "Rules.", "Task.", [("north", "")], "MAP", "LESSON", "Reply.")
    text = tokenizer.decode(ids)
    assert text.index("LESSON") > text.index("<|im_start|>user") and "- north" in text


# ---- flush before rollout, the paper preset -------------------------------------------------------

class GatedScripted(Scripted):
    """A scripted extractor that answers only once ``gate`` is set (a 120 s cap so a broken test cannot
    hang; the test opens the gate itself, so how loaded the machine is does not matter)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def generate(self, prompts, params, allowed=None):
        self.gate.wait(timeout=120.0)
        return super().generate(prompts, params, allowed)


@pytest.mark.parametrize("flush", [True, False])
def test_flush_before_rollout_makes_step_two_see_step_one(tokenizer, tiny_model, flush):
    tr = _trainer(tokenizer, tiny_model, experience={"wait_distill": False, "flush_before_rollout": flush})
    extractor = tr.experience.extractor
    extractor.engine = GatedScripted(tokenizer, "<ops>\n" + ADD + "\n</ops>", extractor.prompts.prefill)
    tr.train_step()
    assert tr.experience.manager.backlog() > 0           # step 1's distillation is still waiting
    if flush:                                            # step 2 must wait for it: open the gate 1 s in
        threading.Timer(1.0, extractor.engine.gate.set).start()
    res = tr.train_step()
    extractor.engine.gate.set()
    guided = [t for t in res.trajectories if t.subgroup == "guided"]
    if flush:
        assert all(t.experience_ids for t in guided) and res.metrics["time_flush_s"] > 0
    else:                                                # rolled out while step 1 was still being distilled
        assert not any(t.experience_ids for t in guided)
    tr.close()


def test_paper_preset_is_the_released_configuration():
    cfg = build_config([preset_data("paper")])
    assert (cfg.experience.capacity, cfg.experience.eviction) == (20000, "fifo")
    assert cfg.experience.warmup_steps == 5 and cfg.experience.actor_critic
    assert cfg.experience.flush_before_rollout and cfg.experience.distill == "guided"
    assert cfg.experience.key == "query" and cfg.experience.placement == "system"
    assert cfg.rollout.prompt == "multiturn" and cfg.generation.max_new_tokens == 4096
    assert (cfg.generation.temperature, cfg.generation.top_p, cfg.generation.top_k) == (0.99, 0.99, 100)
    assert cfg.extractor.format == "json" and cfg.extractor.max_new_tokens == 8192
    assert cfg.extractor.reward == "binary" and cfg.train.loss_agg == "seq-mean-token-mean"
    assert cfg.train.recompute_old_logprobs
    for name in ("default", "smoke"):
        assert not build_config([preset_data(name)]).experience.actor_critic


def test_evaluation_sampled_as_released_uses_the_actors_generating_args(tokenizer, tiny_model):
    """The released validation env managers get the actor's generating args (``agentic_config.py``:
    ``val_env_manager.generating_args = actor_infer.generating_args``). ``eval.temperature`` set to the
    actor's temperature gives evaluation episodes and the judge in evaluation exactly the actor's
    sampling (temperature, top-p, top-k); the default stays greedy."""
    released = {"temperature": 0.99, "top_p": 0.99, "top_k": 100}
    tr = _trainer(tokenizer, tiny_model, generation=released, eval={"temperature": 0.99},
                  experience={"actor_critic": True})
    try:
        for sampling in (tr.eval_sampling, tr.experience._eval_judging):
            assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.99, 0.99, 100)
        assert tr.evaluator.protocol()["temperature"] == 0.99
    finally:
        tr.close()
    greedy = _trainer(tokenizer, tiny_model, generation=released, experience={"actor_critic": True})
    try:
        assert greedy.eval_sampling.temperature == 0.0 == greedy.experience._eval_judging.temperature
    finally:
        greedy.close()
