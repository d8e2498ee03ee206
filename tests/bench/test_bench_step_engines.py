"""``crl-bench bench step --engines``: one trainer per ``generation.engine``, interleaved as the
before/after arms, on the tiny test model; vLLM's construction is replaced by a stand-in (a transformers
engine without prefill counters or a generator, as vLLM's has neither), so no real vLLM starts here
(the real engine's tests: tests/llm/test_vllm_real.py, marked slow)."""

from __future__ import annotations

import pytest

from crl_bench.cli import main

#: a step of the tiny model that fits the test budget: 1 group of 2 episodes, 1 action, 4 new tokens
TINY = {"train": {"groups_per_step": 1, "group_size": 2, "micro_batch_tokens": 256},
        "rollout": {"max_steps": 1}, "generation": {"max_new_tokens": 4}}

#: a roofline (crl_bench.bench.roofline.measure_roofline's keys that bench step reads)
FAKE_ROOF = {"prefill": {"tok_s": 100.0, "batch": 2, "prompt": 8},
             "decode": [{"batch": 2, "tok_s": 50.0, "context": 8}],
             "flops_per_prefill_token": 1e6, "flops_per_token": 1e6, "matmul_flop_s": 1e9}


class StandInVLLM:
    """What the trainer sees of :class:`crl_bench.llm.vllm_engine.VLLMEngine`: generate, sync, close;
    no ``counters`` and no ``generator`` (vLLM keeps its own prefix cache and model)."""

    def __init__(self, model, tokenizer):
        from crl_bench.llm.hf_engine import HFEngine

        self._hf = HFEngine(model, tokenizer)
        self.syncs = 0

    def generate(self, *args, **kwargs):
        return self._hf.generate(*args, **kwargs)

    def sync_weights(self, model):
        self.syncs += 1
        self._hf.sync_weights(model)

    def close(self):
        pass


@pytest.fixture()
def stand_in(monkeypatch):
    from crl_bench.llm import vllm_engine

    built = []

    def from_model(model, tokenizer, model_cfg, gen_cfg=None, seed=0, **kwargs):
        built.append(StandInVLLM(model, tokenizer))
        return built[-1]

    monkeypatch.setattr(vllm_engine.VLLMEngine, "from_model", staticmethod(from_model))
    return built


def test_engine_arms_run_one_trainer_per_engine_and_print_the_table(tiny_model_dir, stand_in, monkeypatch):
    from crl_bench.bench import roofline as roofline_mod
    from crl_bench.bench import step
    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.trainer import loop

    engines = {}
    real_init = loop.Trainer.__init__

    def init(self, cfg, *args, **kwargs):
        real_init(self, cfg, *args, **kwargs)
        engines[cfg.generation.engine] = self.engine

    monkeypatch.setattr(loop.Trainer, "__init__", init)
    measured = []       # the roofline's own probes take seconds; they have tests of their own (test_roofline.py)

    def roofline(generator, dtype, **kwargs):
        measured.append(generator)
        return FAKE_ROOF

    monkeypatch.setattr(roofline_mod, "measure_roofline", roofline)
    # advantages +-1 so that every arm's step updates and syncs (a tiny random model rarely earns a reward)
    monkeypatch.setattr(loop.Trainer, "advantages", lambda self, trajs: [(-1.0) ** k for k in range(len(trajs))])
    res = step.bench_step(str(tiny_model_dir), "sokoban", "smoke", 1, threads=1, overrides=TINY,
                          update_probe=False, arms=step.engine_arms("transformers,vllm"))
    assert isinstance(engines["transformers"], HFEngine) and engines["vllm"] is stand_in[0]
    assert measured == [engines["transformers"].generator]      # the arm with a transformers generator
    assert (res["arms"], res["baseline"], res["target"], res["roofline_arm"]) == (
        ["transformers", "vllm"], "transformers", "vllm", "transformers")
    assert res["transformers"]["steps"] == res["vllm"]["steps"] == 1
    assert res["vllm"]["share_of_pure"] is None and res["transformers"]["share_of_pure"] is not None
    assert res["vllm"]["time_sync_s"] >= 0.0 and stand_in[0].syncs == res["vllm"]["optimizer_steps"] > 0
    text = step.format_step(res)
    rows = {line.split()[0] for line in text.splitlines()[2:4]}
    assert rows == {"transformers", "vllm"}
    assert "vllm / transformers: rollout tok/s" in text
    assert "weight sync per step (part of update s): transformers " in text
    assert "no shares ('-') for vllm" in text


def test_engines_option_is_parsed_into_arms_and_bad_lists_are_usage_errors(monkeypatch, capsys):
    from crl_bench.bench import step

    seen = {}
    monkeypatch.setattr(step, "bench_step", lambda *a, **k: seen.setdefault("k", k) and {})
    monkeypatch.setattr(step, "format_step", lambda res: "table")
    assert main(["bench", "step", "--engines", "vllm,transformers"]) == 0
    assert list(seen["k"]["arms"]) == ["vllm", "transformers"]
    assert seen["k"]["arms"]["vllm"] == ({"generation": {"engine": "vllm"}}, {})
    for bad in ("vllm", "vllm,vllm", "transformers,sglang"):
        with pytest.raises(SystemExit) as e:
            main(["bench", "step", "--engines", bad])
        assert e.value.code == 2


@pytest.mark.parametrize("layer", [{"model": {"lora": True}}, {"backend": "ray"}])
def test_engine_arms_refuse_lora_and_ray_before_loading_a_model(monkeypatch, capsys, layer):
    from crl_bench import config
    from crl_bench.trainer import loop

    monkeypatch.setattr(config, "preset_data", lambda name: layer)
    monkeypatch.setattr(loop, "Trainer", lambda *a, **k: pytest.fail("a trainer was built"))
    assert main(["bench", "step", "--engines", "transformers,vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bench step --engines" in err and "backend=local" in err
