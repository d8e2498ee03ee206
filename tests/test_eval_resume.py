"""`crl-bench eval --run`: an interrupted greedy evaluation keeps its finished modes in
``<out>.partial`` and, run again, evaluates only the rest; a partial file of another evaluation
(other settings, another checkpoint) is not used. The trainer is a stand-in that records which modes
it evaluated (models are not loaded): what is tested is the command's bookkeeping; that a greedy
mode's result does not depend on the modes before it is the trainer's own contract (each evaluation
starts from an empty prefix store, tested with the trainer)."""

from __future__ import annotations

import json

import pytest
from test_summary import make_run

from crl_bench.cli import main
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.types import Operation

MODES = ["free", "guided", "shuffled", "empty"]


class _Interrupted(Exception):
    """Stands for the session ending mid-evaluation."""


class _StandInTrainer:
    """Evaluates a mode by recording it; raises :class:`_Interrupted` at the mode in ``stop_at``."""

    evaluated: list[str] = []
    stop_at: str | None = None

    def __init__(self, cfg, writer=None, read_only_bank=None, **_):
        self.cfg = cfg
        self.evaluator = self           # the trainer's Evaluator: modes, protocol, episode_count, evaluate_modes
        self.modes = list(MODES)
        self.data_files = {}

    def protocol(self):
        return {"split": self.cfg.eval.split, "episodes": self.cfg.eval.episodes,
                "temperature": self.cfg.eval.temperature}

    def episode_count(self, modes=None):
        return 3 * len(modes)

    def evaluate(self, progress=None, mode=None):
        if mode == type(self).stop_at:
            raise _Interrupted(mode)
        type(self).evaluated.append(mode)
        return {"mode": mode, "success_rate": MODES.index(mode) / 10, "episodes": 3}

    def evaluate_modes(self, modes, progress=None, on_mode=None, journal=None):
        """One stream of ``modes``: each mode's block is handed to ``on_mode`` as it ends, in order."""
        out = {}
        for mode in modes:
            out[mode] = self.evaluate(progress, mode)
            if on_mode is not None:
                on_mode(mode, out[mode])
        return out

    def close(self):
        pass


@pytest.fixture()
def stand_in(monkeypatch):
    import crl_bench.trainer.lifecycle as lifecycle

    _StandInTrainer.evaluated = []
    _StandInTrainer.stop_at = None
    monkeypatch.setattr(lifecycle, "Trainer", _StandInTrainer)
    return _StandInTrainer


def _run(tmp_path):
    run = make_run(tmp_path, "cell", method="casebank")
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    bank = ExperienceBank(run / "experience.sqlite", HashEmbedder(384))
    bank.apply([Operation("ADD", "a case", "north, then west")], env_id="sokoban", step=1,
               extraction_id="x", extractor_version=0)
    bank.close()
    return run


def _eval(run, out, *extra):
    return main(["eval", "--run", str(run), "--episodes", "3", "--out", str(out), "--quiet", *extra])


def test_an_interrupted_evaluation_resumes_at_its_first_unfinished_mode(tmp_path, stand_in, capsys):
    run = _run(tmp_path)
    out = tmp_path / "trials.json"
    partial = tmp_path / "trials.json.partial"
    stand_in.stop_at = "shuffled"
    with pytest.raises(_Interrupted):
        _eval(run, out)
    assert stand_in.evaluated == ["free", "guided"]
    assert not out.exists()                            # no leaderboard row from half an evaluation
    assert set(json.loads(partial.read_text())["modes"]) == {"free", "guided"}

    stand_in.stop_at = None
    stand_in.evaluated = []
    capsys.readouterr()
    assert _eval(run, out) == 0
    assert stand_in.evaluated == ["shuffled", "empty"]  # free and guided were not evaluated again
    assert "resuming from" in capsys.readouterr().err
    ev = json.loads(out.read_text())
    assert [m for m in ev if m in MODES] == MODES        # the modes in the order asked
    assert [ev[m]["success_rate"] for m in MODES] == [0.0, 0.1, 0.2, 0.3]
    assert not partial.exists()                         # the whole result replaces the partial file

    stand_in.evaluated = []                              # a finished evaluation starts afresh
    assert _eval(run, out) == 0 and stand_in.evaluated == MODES


@pytest.mark.parametrize("change", ["episodes", "checkpoint", "bank", "sampled", "unreadable"])
def test_a_partial_file_of_another_evaluation_is_not_used(tmp_path, stand_in, change):
    run = _run(tmp_path)
    out = tmp_path / "trials.json"
    stand_in.stop_at = "guided"
    with pytest.raises(_Interrupted):
        _eval(run, out)
    assert stand_in.evaluated == ["free"]
    stand_in.stop_at = None
    stand_in.evaluated = []
    extra: list[str] = []
    if change == "episodes":
        extra = ["--episodes", "4"]                     # the last --episodes is taken
    elif change == "checkpoint":
        (run / "checkpoint" / "model.safetensors").write_bytes(b"other weights")
    elif change == "bank":
        bank = ExperienceBank(run / "experience.sqlite", HashEmbedder(384))
        bank.apply([Operation("ADD", "another case", "south")], env_id="sokoban", step=2,
                   extraction_id="y", extractor_version=0)
        bank.close()
    elif change == "unreadable":
        (tmp_path / "trials.json.partial").write_text('{"key": ')
    else:
        extra = ["--set", "eval.temperature=1.0"]       # sampled: draws depend on earlier modes
    assert _eval(run, out, *extra) == 0
    assert stand_in.evaluated == MODES
    partial = tmp_path / "trials.json.partial"
    if change == "sampled":                             # a sampled evaluation keeps no partial file
        assert list(json.loads(partial.read_text())["modes"]) == ["free"]
    else:
        assert not partial.exists()


def test_out_in_a_missing_folder_is_refused_before_the_trainer_is_built(tmp_path, stand_in, capsys):
    run = _run(tmp_path)
    assert _eval(run, tmp_path / "no-such-folder" / "trials.json") == 2
    assert "no-such-folder" in capsys.readouterr().err and stand_in.evaluated == []
