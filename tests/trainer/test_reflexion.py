"""The ``reflexion`` method in the training loop and in evaluation: the actor reflects on its failed
episodes, reflections are kept per task and shown to later attempts at that task (in evaluation, the
attempts of ``eval.trials``, with the memory controls)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tests_helpers import CoinEnv, coin_config, replay_from_checkpoint

from crl_bench.config import ConfigError
from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.reflections import REFLECTIONS_HEADER, ReflectionWriter
from crl_bench.methods import get_method
from crl_bench.rollout import EpisodeSpec
from crl_bench.trainer.loop import Trainer


@pytest.fixture(autouse=True)
def _coin():
    register_env("test-coin", CoinEnv)


def _trainer(tokenizer, tiny_model, **extra):
    tr = Trainer(coin_config("reflexion", **extra), model=tiny_model, tokenizer=tokenizer, embedder=HashEmbedder(64))
    # the actor's reflection names the task it failed, so that what an attempt is shown is checkable
    tr.experience.memory.reflect = lambda trajs, earlier=None: [
        f"On task {t.task} I called {t.turns[0].action}; call heads." for t in trajs]
    return tr


def test_reflexion_method_spec():
    m = get_method("reflexion")
    assert m.uses_experience and m.memory == "reflections" and not m.uses_extractor and not m.trains_extractor


def test_failed_episodes_are_reflected_on_and_shown_to_later_attempts(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model)
    track = tr.experience
    assert track.model is None and isinstance(track.memory.reflector, ReflectionWriter)
    res = tr.train_step()                                    # warm-up: nothing shown, reflections written
    failed = [t for t in res.trajectories if not t.success]
    assert failed and res.metrics["distill_queued"] == len(failed) == res.metrics["reflections"]
    assert not any(t.guidance for t in res.trajectories)
    t0 = failed[0]
    stored = track.manager.reflections("test-coin", t0.task, 10)
    assert f"On task {t0.task} I called tails; call heads." in stored
    # a guided episode of that task in a later step is shown them; a free one, or another task, is not
    specs = [EpisodeSpec("test-coin", t0.task, subgroup="guided", retrieve=True),
             EpisodeSpec("test-coin", t0.task, subgroup="free"),
             EpisodeSpec("test-coin", 99, subgroup="guided", retrieve=True)]
    own, free, other = tr.experience.place_guidance(specs)
    shown = tr.cfg.experience.reflections.shown
    assert own.guidance.startswith(REFLECTIONS_HEADER) and not own.retrieve
    assert own.guidance.count("Attempt ") == min(len(stored), shown)
    assert free.guidance == "" and other.guidance == "" and not other.retrieve
    tr.train_step()                                          # a guided step runs with reflections wired in
    tr.close()


class _Failing:
    """A runner whose every attempt fails; records the specs (what each attempt was shown)."""

    def __init__(self):
        self.calls: list[list[EpisodeSpec]] = []

    def collect(self, specs, sampling, progress=None, **hooks):
        self.calls.append(list(specs))
        return [SimpleNamespace(env_id=s.env_id, task=s.task, success=False, reward=0.0,
                                turns=[SimpleNamespace(action="tails")]) for s in specs]


@pytest.mark.parametrize("mode", ["guided", "shuffled", "empty", "free"])
def test_evaluation_attempts_see_the_reflections_of_earlier_attempts(tokenizer, tiny_model, mode):
    tr = _trainer(tokenizer, tiny_model, eval={"trials": 3, "episodes": 4})
    runner = _Failing()
    tr.runner = runner
    tasks = tr.evaluator.task_ids()["test-coin"]
    donors = tr.evaluator.shuffled_donors({"test-coin": tasks})["test-coin"] if mode == "shuffled" else {}
    between = tr.experience.eval_attempts(mode, {"test-coin": donors}) if mode != "free" else None
    prepare, learn = (between.prepare, between.learn) if between is not None else (None, None)
    specs = [EpisodeSpec("test-coin", t, group_id=i, subgroup="guided") for i, t in enumerate(tasks)]
    tr.evaluator.trials(specs, None, {}, prepare, learn)
    assert len(runner.calls) == 3
    # every task fails every attempt: attempts 2 and 3 of each are shown reflections (not in empty)
    assert (between.metrics()["attempts_with_reflections"] if between else 0) == \
        (0 if mode in ("free", "empty") else 2 * len(tasks))
    first, third = runner.calls[0], runner.calls[2]
    if mode == "free":
        assert all(s.guidance == "" for s in first + third)
    elif mode == "empty":
        assert all(s.guidance == tr.experience.empty_guidance for s in first + third)
    else:
        assert all(s.guidance == "" for s in first)          # nothing stored yet for new eval tasks
        for s in third:
            seen = donors[s.task] if mode == "shuffled" else s.task
            assert s.guidance.startswith(REFLECTIONS_HEADER)
            assert s.guidance.count(f"On task {seen} I called tails") == 2    # attempts 1 and 2 of that task
            if mode == "shuffled":
                assert f"On task {s.task} " not in s.guidance
    # evaluation never writes the bank
    assert all(tr.experience.manager.reflections("test-coin", t, 10) == [] for t in tasks)
    tr.close()


def test_reflexion_evaluation_end_to_end(tokenizer, tiny_model):
    tr = _trainer(tokenizer, tiny_model, eval={"trials": 2, "episodes": 3})
    ev = tr.evaluator.evaluate_all()
    assert set(ev) >= {"free", "guided", "shuffled", "empty"} and ev["protocol"]["trials"] == 2
    for mode in ("free", "guided", "shuffled", "empty"):
        assert len(ev[mode]["success_by_trial"]) == 2
        # the reflections shown are counted apart: they are not bank entries
        assert ev[mode]["episodes_with_experience"] == 0
    # guided: every second attempt (a task the first did not solve) is shown the reflection on the first
    assert ev["guided"]["attempts_with_reflections"] == ev["guided"]["attempts"] - 3
    assert ev["empty"]["attempts_with_reflections"] == 0 and "attempts_with_reflections" not in ev["free"]
    tr.close()


@pytest.mark.parametrize("key, value", [("integration", "turn"), ("search_tool", "all")])
def test_reflexion_refuses_settings_it_cannot_honour(key, value):
    with pytest.raises(ConfigError, match=f"experience.{key}"):
        coin_config("reflexion", experience={key: value}, generation={"constrained": False})


def test_a_resumed_reflexion_run_takes_the_same_next_steps(tmp_path, tokenizer, tiny_model):
    """Two steps, a checkpoint, two more; a trainer restored from the checkpoint takes the same two
    steps (the same reflections shown) and ends with the same reflections stored."""
    import copy
    import sqlite3

    from test_resume import _computed

    from crl_bench.results.run_folder import RunWriter

    def make(run_dir):
        cfg = coin_config("reflexion", train={"steps": 4, "lr_warmup_steps": 2, "seed": 1}, model={"dtype": "float32"})
        writer = RunWriter(run_dir.parent, run_dir.name) if not run_dir.exists() else RunWriter.reopen(run_dir)
        tr = Trainer(cfg, writer=writer, model=copy.deepcopy(tiny_model), tokenizer=tokenizer,
                     embedder=HashEmbedder(64))
        tr.experience.memory.reflect = lambda trajs, earlier=None: [f"On task {t.task} call heads." for t in trajs]
        return tr

    def rows(d):
        c = sqlite3.connect(f"file:{d / 'experience.sqlite'}?mode=ro", uri=True)
        try:
            return c.execute("SELECT id, env_id, task, text, step FROM reflections ORDER BY id").fetchall()
        finally:
            c.close()

    a, b = replay_from_checkpoint(make, tmp_path, _computed)
    b_dir = b.writer.dir
    assert rows(a.writer.dir) == rows(b_dir) and rows(b_dir)
