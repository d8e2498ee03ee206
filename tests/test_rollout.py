"""The rollout loop with a tiny random model on real envs."""

import numpy as np
import pytest
import torch

from crl_bench.env_api import TextEnv, register_env
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.hf_engine import HFEngine
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner


def _runner(tokenizer, model, constrained=True, max_steps=4, max_new_tokens=8):
    engine = HFEngine(model, tokenizer, batch_size=4)
    return RolloutRunner(engine, PromptBuilder(tokenizer), EnvPool(max_steps=max_steps),
                         SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), constrained)


def test_constrained_rollout_is_always_valid(tokenizer, tiny_model):
    runner = _runner(tokenizer, tiny_model)
    specs = [EpisodeSpec("sokoban", t, group_id=t // 2) for t in range(4)] + \
            [EpisodeSpec("minihack-room", 1_000_000, group_id=9)]
    trajs = runner.collect(specs)
    assert [t.task for t in trajs] == [s.task for s in specs]
    for tr in trajs:
        assert tr.steps == len(tr.turns) and 1 <= tr.steps <= 4
        assert tr.invalid_actions == 0 and not tr.error
        assert tr.terminated or tr.truncated
        for turn in tr.turns:
            assert turn.action is not None and not turn.invalid
            assert len(turn.logprobs) == len(turn.response_ids) > 0
            assert all(lp <= 0.0 for lp in turn.logprobs)
            mask = turn.action_mask
            assert len(mask) == len(turn.prompt_ids) + len(turn.response_ids)
            assert sum(mask) == len(turn.response_ids) and mask[-1] == 1 and mask[0] == 0
            text = tokenizer.decode(turn.response_ids)
            assert text.endswith("</answer>")
    st = runner.last_stats
    assert st.generated_tokens == sum(t.response_tokens for t in trajs)
    assert st.generate_calls >= 1


def test_unconstrained_garbage_is_invalid_not_a_crash(tokenizer, tiny_model):
    runner = _runner(tokenizer, tiny_model, constrained=False, max_steps=3, max_new_tokens=4)
    trajs = runner.collect([EpisodeSpec("sokoban", 5), EpisodeSpec("sokoban", 6)])
    for tr in trajs:
        assert tr.steps == 3 and tr.truncated
        # a random 2-layer model essentially never spells an action and a closing tag in 4 tokens
        assert tr.invalid_actions == sum(t.invalid for t in tr.turns)
    assert sum(tr.invalid_actions for tr in trajs) >= 5


class _Crashing(TextEnv):
    env_id = "test-crash"
    system_prompt = "Say go."

    def _reset_task(self, task):
        self.n = 0

    def _apply(self, action):
        self.n += 1
        if self.task == 1:
            raise RuntimeError("simulator died")
        return 0.0, self.n >= 2, False, "ok"

    def _observe(self, message=""):
        return f"obs {message}"

    def admissible_actions(self):
        return ["go"]


def test_env_crash_fails_only_that_episode(tokenizer, tiny_model):
    register_env("test-crash", _Crashing)
    runner = _runner(tokenizer, tiny_model)
    trajs = runner.collect([EpisodeSpec("test-crash", 0), EpisodeSpec("test-crash", 1),
                            EpisodeSpec("test-crash", 2)])
    assert "simulator died" in trajs[1].error and not trajs[1].success
    assert trajs[0].steps == 2 and trajs[2].steps == 2 and not trajs[0].error
    # the crashed env was discarded: the pool hands out a fresh one next time
    again = runner.collect([EpisodeSpec("test-crash", 3)])
    assert again[0].steps == 2


def test_prompt_has_system_task_history_and_prefill(tokenizer):
    pb = PromptBuilder(tokenizer, prefill="<answer>", history=1)
    user = pb.user_text("Reach the stairs.", [("north", ""), ("east", "Invalid action: x")], "MAP")
    assert "Task: Reach the stairs." in user and "- east -> Invalid action: x" in user
    assert "north" not in user                   # only the last `history` actions
    text = tokenizer.decode(pb.build("SYSTEM", user))
    assert text.startswith("<|im_start|>system\nSYSTEM") and text.endswith("<|im_start|>assistant\n<answer>")


def test_unknown_env_names_known_ones():
    with pytest.raises(KeyError, match="sokoban"):
        EnvPool().acquire("no-such-env")


def test_prefix_cache_gives_identical_replies_and_logprobs(tokenizer, tiny_model):
    from crl_bench.env_api import make_env

    pb = PromptBuilder(tokenizer)
    prompts, allowed = [], []
    for t in range(5):
        env = make_env("sokoban")
        obs, _ = env.reset(options={"task": t})
        prompts.append(pb.build(env.system_prompt, pb.user_text(env.task_prompt(), [], obs)))
        allowed.append([a + "</answer>" for a in env.admissible_actions()])
    params = SamplingParams(temperature=0, max_new_tokens=6)
    outs = []
    for cache in (False, True):
        eng = HFEngine(tiny_model, tokenizer, batch_size=8, prefix_cache=cache)
        first = eng.generate(prompts, params, allowed)
        heads = eng.counters["head_tokens"]
        outs.append(first + eng.generate(prompts, params, None))
        if cache:
            assert len(eng.store) >= 1        # shared heads computed once, reused by the 2nd call
            assert eng.counters["head_tokens"] == heads > 0
            assert eng.counters["cached_tokens"] > 2 * heads
            eng.sync_weights(tiny_model)
            assert not len(eng.store)         # dropped when weights change
    for a, b in zip(*outs):
        assert a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_group_heads_and_episode_reuse_equal_the_uncached_path(tokenizer, tiny_model):
    """Multi-turn rollouts of 2 groups x 3 (identical first prompts within a group): with the prefix
    store (group heads, then each episode's previous prompt + reply) the replies and log-probs are
    those of the uncached engine, and most prompt tokens come from the store."""
    specs = [EpisodeSpec("sokoban", t, group_id=t) for t in (0, 1) for _ in range(3)]
    outs, engines = [], []
    for cache in (False, True):
        eng = HFEngine(tiny_model, tokenizer, batch_size=8, prefix_cache=cache, keep_sequences=True)
        runner = RolloutRunner(eng, PromptBuilder(tokenizer, layout="multiturn"), EnvPool(max_steps=4),
                               SamplingParams(temperature=0, max_new_tokens=8), constrained=False)
        outs.append(runner.collect(specs))
        engines.append(eng)
    turns = 0
    for a, b in zip(*outs):
        assert len(a.turns) == len(b.turns)
        for ta, tb in zip(a.turns, b.turns):
            assert ta.prompt_ids == tb.prompt_ids
            assert ta.response_ids == tb.response_ids
            assert ta.logprobs == pytest.approx(tb.logprobs, abs=1e-4)
            turns += 1
    assert turns > len(specs)                              # episodes went past their first turn
    plain, cached = (e.counters for e in engines)
    assert plain["cached_tokens"] == 0 and plain["prefill_tokens"] == plain["prompt_tokens"]
    assert cached["prompt_tokens"] == plain["prompt_tokens"]
    assert cached["cached_tokens"] > 0.6 * cached["prompt_tokens"]


def test_prefix_store_keeps_longest_and_respects_its_bound():
    from crl_bench.llm.hf_engine import PrefixStore

    def kv(n):
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]

    store = PrefixStore(max_bytes=64 * 200)            # 200 tokens of this shape (64 bytes each)
    store.put(np.arange(50), kv(50))
    store.put(np.arange(80), kv(80))                   # extends the first: replaces it
    assert len(store) == 1
    store.put(np.arange(60), kv(60))                   # covered by the stored 80: nothing added
    assert len(store) == 1
    p, n = store.match(np.concatenate([np.arange(70), [999, 1]]), limit=100)
    assert n == 70 and len(p.tokens) == 80
    assert store.match(np.arange(200), limit=10)[1] == 10
    store.put(np.concatenate([[7], np.arange(120)]), kv(121))
    store.put(np.concatenate([[8], np.arange(90)]), kv(91))    # over the bound: the oldest goes
    assert store.nbytes <= store.max_bytes
    assert store.match(np.arange(80), limit=100)[1] == 0


def test_history_carries_env_feedback(tokenizer, tiny_model):
    """The 'Last: ...' feedback of a step reaches the next prompt's action history."""
    runner = _runner(tokenizer, tiny_model, max_steps=3)
    tr = runner.collect([EpisodeSpec("sokoban", 0)])[0]
    second = tokenizer.decode(tr.turns[1].prompt_ids)
    from crl_bench.env_api import feedback_of

    fb = feedback_of(tr.turns[1].observation)
    assert fb and f"- {tr.turns[0].action} -> {fb}" in second


def test_waves_bound_live_episodes_and_keep_order(tokenizer, tiny_model):
    """max_concurrent=2 runs 5 specs in 3 waves; results come back in spec order, and no more than 2
    env instances are ever created."""
    from tests_helpers import CoinEnv

    from crl_bench.env_api import register_env
    from crl_bench.llm.base import SamplingParams

    created = []

    def factory(**kw):
        env = CoinEnv(**kw)
        created.append(env)
        return env

    register_env("coin-waves", factory)
    pool = EnvPool(max_steps=2)
    runner = RolloutRunner(HFEngine(tiny_model, tokenizer, batch_size=4), PromptBuilder(tokenizer), pool,
                           SamplingParams(temperature=1.0, max_new_tokens=8), max_concurrent=2)
    specs = [EpisodeSpec("coin-waves", task=t, group_id=t) for t in range(5)]
    trajs = runner.collect(specs)
    assert [t.task for t in trajs] == list(range(5))
    assert len(created) == 2
    assert all(t.steps >= 1 for t in trajs)
    assert runner.last_stats.generate_calls >= 3


def test_constrained_reply_longer_than_the_budget_is_completed(tokenizer, tiny_model):
    from crl_bench.llm.base import SamplingParams

    eng = HFEngine(tiny_model, tokenizer, batch_size=2)
    long = "take the very long named object number one from the far away receptacle 7</answer>"
    assert len(tokenizer.encode(long, add_special_tokens=False)) > 8
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    gen = eng.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=4), [[long]])[0]
    assert gen.text.strip().endswith("</answer>") and long.startswith(gen.text.strip()[:10])


def test_background_engine_prefills_in_chunks_with_the_same_outputs(tokenizer, tiny_model):
    """A background engine (distillation) computes its prompts 16 tokens at a time, yielding to the
    foreground between chunks; replies and log-probs equal the plain engine's."""
    from crl_bench.llm.gate import ComputeGate

    prompts = [tokenizer.encode(f"Episode {i}: the agent moved north, then east, then picked up the key "
                                f"and opened door number {i * 7}. What lesson do you draw?") for i in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    plain = HFEngine(tiny_model, tokenizer, prefix_cache=False).generate(prompts, params)
    gate = ComputeGate()
    eng = HFEngine(tiny_model, tokenizer, gate=gate, background=True, prefill_chunk=16, min_prefix=8)
    chunked = eng.generate(prompts, params)
    for a, b in zip(plain, chunked):
        assert a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # everything but each prompt's last token came from the chunks
    assert eng.counters["prefill_tokens"] == len(prompts)
    assert eng.counters["head_tokens"] == sum(len(p) - 1 for p in prompts)


class _Talkative:
    """An engine whose every reply is a valid Sokoban action followed by ~40 tokens of chatter; records
    the prompt lengths it was asked to continue."""

    REPLY = "up</answer> " + "and then I would think about the boxes and walls some more " * 4

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prompt_lengths: list[int] = []

    def generate(self, prompts, params, allowed=None):
        from crl_bench.llm.base import Generation

        out = []
        for p in prompts:
            self.prompt_lengths.append(len(p))
            ids = self.tokenizer.encode(self.REPLY, add_special_tokens=False)[:params.max_new_tokens]
            out.append(Generation(list(p), ids, [-1.0] * len(ids), self.tokenizer.decode(ids), "length",
                                  {"entropy": [0.5] * len(ids)}))
        return out


def test_a_reply_gets_what_the_context_leaves_and_a_full_context_ends_the_episode(tokenizer):
    """As released (``TrajEnvManager.make_decision``: ``max_new_tokens = min(..., sequence_length -
    prompt length)``, and ``MAX_LENGTH`` ends the episode when the prompt fills ``sequence_length``): a
    reply is cut to the room its prompt leaves, and an episode whose next prompt fills the context
    ends there, truncated, without another generate call; other episodes go on."""
    engine = _Talkative(tokenizer)
    prompts = PromptBuilder(tokenizer, layout="multiturn")
    first = RolloutRunner(engine, prompts, EnvPool(max_steps=6), SamplingParams(temperature=1.0, max_new_tokens=64),
                          constrained=False).collect([EpisodeSpec("sokoban", 0)])[0]
    assert first.steps == 6 and not first.context_full            # no limit: the step limit ends it
    p1 = len(first.turns[0].prompt_ids)
    room = 12
    engine.prompt_lengths.clear()
    runner = RolloutRunner(engine, prompts, EnvPool(max_steps=6),
                           SamplingParams(temperature=1.0, max_new_tokens=64), constrained=False,
                           max_context_tokens=p1 + room)
    tr = runner.collect([EpisodeSpec("sokoban", 0)])[0]
    (turn,) = tr.turns                                                # the second prompt no longer fits
    assert len(turn.response_ids) == room == len(turn.logprobs) == len(turn.entropy)
    assert turn.reply.endswith(tokenizer.decode(turn.response_ids)) and turn.action == "up"
    assert tr.context_full and tr.truncated and not tr.terminated and not tr.success
    assert tr.steps == 1 and engine.prompt_lengths == [p1]            # no generate call past the limit


def test_an_env_that_keys_its_entries_gives_the_key_when_the_episode_ends(tokenizer):
    """``TextEnv.entry_key`` (MiniHack's released raw key) is read when the episode ends, told whether
    the first reply went to the env, and the entries distilled from the episode are keyed by it."""
    from tests_helpers import CoinEnv, ScriptedReplies, coin_config

    from crl_bench.experience.lessons import LessonsMemory

    class KeyedCoin(CoinEnv):
        env_id = "test-keyed-coin"
        has_entry_key = True

        def entry_key(self, first_turn_acted):
            return f"key acted={first_turn_acted} steps={self._steps}"

    register_env("test-keyed-coin", KeyedCoin)
    runner = RolloutRunner(ScriptedReplies(tokenizer, lambda text: "heads</answer>"), PromptBuilder(tokenizer),
                           EnvPool(max_steps=2), SamplingParams(max_new_tokens=8), constrained=False)
    keyed, plain = runner.collect([EpisodeSpec("test-keyed-coin", 1, subgroup="guided"),
                                   EpisodeSpec("sokoban", 0, subgroup="guided")])
    assert keyed.key == "key acted=True steps=1" and keyed.query.startswith("Goal:")
    assert plain.key == ""
    memory = LessonsMemory(coin_config("complementary"))
    assert [r.key_text for r in memory.requests([keyed, plain], 0)] == [keyed.key, plain.query]
