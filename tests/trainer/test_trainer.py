"""One GRPO training step of the real loop with a tiny random model on a toy env with mixed outcomes."""

import pytest
import torch
from tests_helpers import CoinEnv

from crl_bench.config import build_config, preset_data
from crl_bench.env_api import register_env
from crl_bench.rollout import Trajectory, Turn
from crl_bench.trainer.loop import Trainer, summarise


@pytest.fixture(autouse=True)
def _coin_env():
    register_env("test-coin", CoinEnv)


def _cfg(**train):
    return build_config([preset_data("smoke"), {
        "rollout": {"mix": "test-coin", "max_steps": 2},
        "train": {"groups_per_step": 2, "group_size": 8, "lr": 1e-3, **train},
        "model": {"gradient_checkpointing": False}, "eval": {"episodes": 4}}])


def test_grpo_step_updates_full_model(tokenizer, tiny_model):
    tr = Trainer(_cfg(), model=tiny_model, tokenizer=tokenizer)
    before = tiny_model.lm_head.weight.detach().clone()
    res = tr.train_step()
    m = res.metrics
    assert m["episodes"] == 16 and m["step"] == 1
    assert 0.0 < m["success_rate"] < 1.0            # mixed outcomes: there is a learning signal
    assert m["groups_with_signal"] >= 1 and m["optimizer_steps"] == 1
    assert 0 < m["rss_gb"] <= m["peak_rss_gb"] * 1.01          # resident memory after the step's heap trim
    assert not torch.equal(before, tiny_model.lm_head.weight)
    # advantages are centred within each group
    advs = tr.advantages(res.trajectories)
    for g in {t.group_id for t in res.trajectories}:
        assert sum(a for a, t in zip(advs, res.trajectories) if t.group_id == g) == pytest.approx(0.0, abs=1e-6)
    ev = tr.evaluator.evaluate()
    assert ev["episodes"] == 4 and ev["tasks"] == {"test-coin": [100, 101, 102, 103]}
    tr.close()


def test_lesson_follow_is_off_by_default_and_on_in_the_diag_preset(tokenizer, tiny_model):
    """The probe means something only for an actor trained on a diagnostic: off unless asked (the diag
    preset asks for all 8 contexts), and off means no probe is built and no metric is logged."""
    assert build_config([]).eval.lesson_follow == 0
    assert build_config([preset_data("diag")]).eval.lesson_follow == 8
    tr = Trainer(_cfg(), model=tiny_model, tokenizer=tokenizer)
    try:
        m = tr.train_step().metrics
        assert not any(k.startswith("lesson_follow") for k in m) and tr._lesson_probe is None
        assert "lesson_follow" not in tr.evaluator.evaluate_all()
    finally:
        tr.close()


def test_eval_all_and_protocol(tokenizer, tiny_model):
    """`eval.episodes: all` evaluates every eval task; grpo's eval.json has only the free block, with
    the protocol that makes it comparable (docs/evaluation.md)."""
    cfg = _cfg()
    cfg.eval.episodes = "all"
    cfg.eval.lesson_follow = 8
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    n_eval = len(tr.eval_tasks["test-coin"])
    assert tr.evaluator.task_ids() == {"test-coin": [int(t) for t in tr.eval_tasks["test-coin"]]}
    assert tr.evaluator.task_ids(3) == {"test-coin": [int(t) for t in tr.eval_tasks["test-coin"][:3]]}
    ev = tr.evaluator.evaluate_all()
    assert set(ev) == {"step", "protocol", "free", "lesson_follow"}     # eval.lesson_follow: the final actor
    assert ev["free"]["episodes"] == n_eval and ev["free"]["guided"] is False
    p = ev["protocol"]
    assert p["episodes"] == "all" and p["tasks_per_env"] == {"test-coin": n_eval}
    assert p["max_steps"] == {"test-coin": 2} and p["temperature"] == cfg.eval.temperature
    row = ev["free"]["per_env"]["test-coin"]
    assert row["score_mean"] == pytest.approx(ev["free"]["reward_mean"]) and "per_type" not in row
    with pytest.raises(ValueError, match="experience bank"):
        tr.evaluator.evaluate(guided=True)
    tr.close()


def test_grpo_step_with_lora_and_kl(tokenizer, tiny_model):
    cfg = _cfg(kl_coef=0.05)
    cfg.model.lora = True
    cfg.model.lora_r = 4
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    m = tr.train_step().metrics
    assert m["optimizer_steps"] == 1 and "kl" in m
    tr.close()


def test_learning_signal_makes_the_winning_action_likelier(tokenizer, tiny_model):
    """A few GRPO steps on the coin env raise the policy's probability of 'heads' (the loop learns)."""
    from crl_bench.trainer.policy import TokenSample, build_batch, sequence_logprobs

    tr = Trainer(_cfg(lr=3e-3), model=tiny_model, tokenizer=tokenizer)
    env = tr.pool.acquire("test-coin")
    obs, _ = env.reset(options={"task": 0})
    prompt = tr.prompts.build(env.system_prompt, tr.prompts.user_text(env.task_prompt(), [], obs))

    def p_heads() -> float:
        lps = []
        for reply in ("heads</answer>", "tails</answer>"):
            ids = tokenizer.encode(reply, add_special_tokens=False)
            b = build_batch([TokenSample(prompt, ids, [0.0] * len(ids), 0.0)], tokenizer.pad_token_id)
            with torch.no_grad():
                lps.append(float(sequence_logprobs(tr.model, b).sum()))
        return float(torch.softmax(torch.tensor(lps), 0)[0])

    before = p_heads()
    for _ in range(4):
        tr.train_step()
    after = p_heads()
    assert after > before + 0.05, (before, after)
    tr.close()


def _episode(env_id, success, reward, steps, invalid, turns=(), error=""):
    return Trajectory(env_id, 0, 0, "free", turns=[Turn([1], [2] * len(e), [0.0] * len(e), "up", False, 0.0,
                                                        entropy=list(e), sampling_entropy=list(s))
                                                   for e, s in turns],
                      reward=reward, success=success, steps=steps, invalid_actions=invalid, error=error)


def test_summarise_empty_and_mixed():
    assert summarise([]) == {"episodes": 0, "success_rate": 0.0, "reward_mean": 0.0, "steps_mean": 0.0,
                             "invalid_action_rate": 0.0, "env_errors": 0}
    # mixed: two envs, interleaved; successes and failures in each; one env error; turns with and
    # without entropies (the last has no sampling entropies: left out of reply_entropy)
    trajs = [_episode("sokoban", True, 1.0, 3, 1, turns=[([0.5, 1.5], [0.2, 0.4]), ([1.0], [0.3])]),
             _episode("minihack", False, 0.0, 2, 0, error="env crashed"),
             _episode("sokoban", False, 0.0, 5, 2, turns=[([2.0], [])]),
             _episode("minihack", True, 1.0, 2, 1),
             _episode("minihack", True, 0.5, 3, 0)]
    assert summarise(trajs) == {
        "episodes": 5,
        "success_rate": pytest.approx(3 / 5),
        "reward_mean": pytest.approx((1.0 + 0.0 + 0.0 + 1.0 + 0.5) / 5),          # 0.5
        "steps_mean": pytest.approx((3 + 2 + 5 + 2 + 3) / 5),                      # 3.0
        "invalid_action_rate": pytest.approx((1 + 0 + 2 + 1 + 0) / 15),            # per action, not episode
        "env_errors": 1,
        "entropy": pytest.approx((0.5 + 1.5 + 1.0 + 2.0) / 4),                    # per token: 1.25
        "reply_entropy": pytest.approx(((0.2 + 0.4) + 0.3) / 2),                   # per turn, summed: 0.45
        "success_rate/minihack": pytest.approx(2 / 3),
        "success_rate/sokoban": pytest.approx(1 / 2),
    }
    # one env: no per-env rates; no entropies reported (vLLM): no entropy keys
    one = summarise(trajs[2:3])
    assert one == {"episodes": 1, "success_rate": 0.0, "reward_mean": 0.0, "steps_mean": 5.0,
                   "invalid_action_rate": pytest.approx(2 / 5), "env_errors": 0, "entropy": 2.0}
    assert "entropy" not in summarise(trajs[1:2]) and "reply_entropy" not in summarise(trajs[1:2])


def test_progress_note_gives_last_step_and_eta():
    from crl_bench.trainer.lifecycle import format_duration, progress_note

    assert progress_note([], 5) == ""
    assert progress_note([100.0, 140.0], 98) == " (last step 2 min, ETA 3.3 h for 98 more)"
    assert [format_duration(x) for x in (45, 600, 12_000)] == ["45 s", "10 min", "3.3 h"]


def test_the_rollout_keeps_to_the_actors_context_window(tokenizer, tiny_model):
    """``rollout.max_context_tokens`` 0 is the actor's ``max_position_embeddings``; a setting overrides
    it (the ``paper`` preset: 32,768, the released ``sequence_length``)."""
    tr = Trainer(_cfg(), model=tiny_model, tokenizer=tokenizer)
    assert tr.runner.max_context_tokens == tiny_model.config.max_position_embeddings == 2048
    tr.close()
    cfg = _cfg()
    cfg.rollout.max_context_tokens = 300
    tr = Trainer(cfg, model=tiny_model, tokenizer=tokenizer)
    assert tr.runner.max_context_tokens == 300
    tr.close()
    assert build_config([preset_data("paper")]).rollout.max_context_tokens == 32768
