"""Every registered memory kind keeps the :class:`~crl_bench.experience.memory.Memory` contract, as
Gymnasium's env checker checks envs: its declared properties, what a finished step writes, what a
guided episode is shown, its metrics keys in the step's row, and its state through a checkpoint. And a
new kind written as one module (tests/tally_memory.py) plus a ``MethodSpec`` registered with
``register_method`` trains and evaluates end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from tally_memory import TALLY, TALLY_HEADER
from tests_helpers import CoinEnv, coin_config, install_lesson_writer

from crl_bench import methods
from crl_bench.env_api import register_env
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.memory import Memory, get_memory, list_memories
from crl_bench.results.run_folder import RunWriter
from crl_bench.rollout import EpisodeSpec
from crl_bench.trainer.checkpoint import load_checkpoint, restore_run_files, save_checkpoint
from crl_bench.trainer.loop import Trainer

# the base metrics every experience step writes, whatever the kind
BASE_KEYS = {"bank_size", "extractions_step", "distill_queued", "distill_backlog", "success_rate/guided",
             "success_rate/free", "guided_with_experience", "extractions_credited"}


@pytest.fixture(autouse=True)
def _coin_and_tally(monkeypatch):
    """The coin env, and the ``tally`` method registered for this test only (the method registry is
    restored afterwards, so the built-in list other tests check is unchanged)."""
    register_env("test-coin", CoinEnv)
    monkeypatch.setattr(methods, "_METHODS", dict(methods._METHODS))
    methods.register_method(TALLY)


def _method_of(kind: str) -> str:
    """A registered method whose bank is of memory kind ``kind`` (its extractor frozen, if any)."""
    return next(name for name in methods.list_methods()
                if (spec := methods.get_method(name)).uses_experience and spec.memory == kind
                and not spec.trains_extractor)


def _trainer(run_dir: Path, method: str, tokenizer, model) -> Trainer:
    cfg = coin_config(method, train={"steps": 6, "seed": 3}, model={"dtype": "float32"})
    writer = RunWriter(run_dir.parent, run_dir.name) if not run_dir.exists() else RunWriter.reopen(run_dir)
    tr = Trainer(cfg, writer=writer, model=model, tokenizer=tokenizer, embedder=HashEmbedder(64))
    memory = tr.experience.memory
    if hasattr(memory, "reflect"):        # the tiny actor's reflections are noise: name the episode instead
        memory.reflect = lambda trajs, earlier=None: [f"On task {t.task} I called {t.turns[0].action}." for t in trajs]
    return tr


@pytest.mark.parametrize("kind", list_memories())
def test_memory_kind_contract(kind, tmp_path, tokenizer, tiny_model, monkeypatch):
    import copy

    install_lesson_writer(monkeypatch)          # a bank of lessons gets a lesson per extraction
    cls = get_memory(kind)
    # declared properties
    assert issubclass(cls, Memory) and cls.name == kind and cls.header.strip()
    assert not cls.trainable or cls.uses_extractor
    method = _method_of(kind)
    assert methods.get_method(method).uses_extractor == cls.uses_extractor

    actor = copy.deepcopy(tiny_model)
    a = _trainer(tmp_path / "a", method, tokenizer, copy.deepcopy(actor))
    track = a.experience
    assert isinstance(track.memory, cls)
    assert cls.header in track.empty_guidance                # the empty control shows the kind's header
    rows = [a.train_step().metrics for _ in range(3)]
    track.flush()
    # write: the warm-up step already writes; what a step queued is counted
    assert all(isinstance(r["distill_queued"], int) and r["distill_queued"] >= 0 for r in rows)
    assert sum(r["distill_queued"] for r in rows) > 0
    # metrics: the base keys and the kind's own, in every row
    stats = track.manager.stats()
    kind_keys = set(track.memory.metrics(track.manager, stats))
    assert all(BASE_KEYS | kind_keys <= set(r) for r in rows), kind_keys - set(rows[-1])
    guided = [EpisodeSpec("test-coin", 3, subgroup="guided", retrieve=True)]
    # guide: a kind that retrieves makes a block from what it found; one that does not, per task
    if cls.retrieves:
        query = a.evaluator.first_query("test-coin", 3)
        (g,) = track.guide([("test-coin", "Call the coin.", query)], count_retrievals=False)
        assert isinstance(g.text, str) and g.record.guidance == g.text
        assert track.place_guidance(guided) == guided
    else:
        (spec,) = track.place_guidance(guided)
        assert not spec.retrieve and isinstance(spec.guidance, str)
        assert spec.guidance == "" or cls.header in spec.guidance
    # state: a checkpoint keeps the track's and the kind's state; a fresh trainer loads it
    state = track.state_dict()
    ckpt = save_checkpoint(a, a.writer.dir, keep=1)
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    restore_run_files(b_dir, ckpt, has_bank=True)
    b = _trainer(b_dir, method, tokenizer, copy.deepcopy(actor))
    load_checkpoint(b, ckpt)
    assert b.experience.memory.state_dict() == state["memory"] == track.memory.state_dict()
    # a track state without the kind's entry (checkpoints of kinds that keep none) loads too
    b.experience.load_state_dict({k: v for k, v in state.items() if k != "memory"})
    b.experience.load_state_dict(state)
    assert b.experience.manager.stats()["bank_size"] == stats["bank_size"]
    assert b.experience.empty_guidance == track.empty_guidance
    row = b.train_step().metrics                       # and trains on
    assert BASE_KEYS | kind_keys <= set(row)
    a.close()
    b.close()


def test_a_new_memory_kind_is_one_module_and_a_method_spec(tmp_path, tokenizer, tiny_model):
    """``tally`` (tests/tally_memory.py) trains, keeps its state and is evaluated guided without any
    change to the package: its notes fill the bank through its own request type, its tally is shown to
    guided episodes and counted in the metrics."""
    tr = _trainer(tmp_path / "run", "tally", tokenizer, tiny_model)
    assert tr.experience.manager.has_model is False and tr.experience.model is None   # no extractor model
    results = [tr.train_step() for _ in range(3)]
    tr.experience.flush()
    rows = [r.metrics for r in results]
    assert all("tally_wins" in r for r in rows) and rows[-1]["bank_size"] > 0
    wins = sum(1 for r in results[:2] for t in r.trajectories if t.success)
    assert tr.experience.memory.state_dict()["wins"] or not wins
    shown = [t.guidance for t in results[-1].trajectories if t.subgroup == "guided"]
    assert shown and all(g.startswith(TALLY_HEADER) for g in shown)       # notes found after the warm-up
    ev = tr.evaluator.evaluate(episodes=4, mode="guided")
    assert ev["guided"] and ev["episodes_with_experience"] == ev["episodes"] == 4
    empty = tr.evaluator.evaluate(episodes=2, mode="empty")
    assert empty["episodes_with_experience"] == 0
    assert tr.experience.empty_guidance == f"{TALLY_HEADER}\n\n(no entries)"
    tr.close()
