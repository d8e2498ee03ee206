"""The GPU memory plan (trainer/memory_plan.py, ``crl-bench plan``) on 7B- and 4B-shaped configurations (the
paper's actor and extractor, counted on the meta device; no weights): today's layout of the paper preset is
refused with the figures a reading of the code gives, small models fit, the updaters' GPU demands and vLLM's
start-up checks are modelled, and ``run`` refuses a layout that does not fit before it loads a model."""

from __future__ import annotations

import json

import pytest

from crl_bench.bench.update_peak import shape_config
from crl_bench.config import build_config, preset_data
from crl_bench.trainer.memory_plan import GIB, ModelShape, format_plan, plan_memory


def _qwen25_7b():
    return shape_config("qwen2.5-7b")


def _qwen3_4b():
    return shape_config("qwen3-4b")


@pytest.fixture(scope="module")
def shapes():
    return ModelShape.from_config(_qwen25_7b(), "7b"), ModelShape.from_config(_qwen3_4b(), "4b")


#: the paper preset with its roles unplaced, as crl-bench laid them out before ``devices``: everything on the
#: driver's GPU 0, one-process updates, each engine at half a card
UNPLACED = {"devices": {"driver": "cuda", "actor_engine": [], "extractor_engine": [], "actor_train": [],
                        "extractor_train": [], "weight_sync": "host"},
            "train": {"workers": 1, "sharding": "ddp"},
            "generation": {"vllm_gpu_memory_utilization": 0.5}, "extractor": {"vllm_gpu_memory_utilization": None}}


def _paper(**layers):
    """The paper preset's complementary run, unplaced (:data:`UNPLACED`), with ``layers`` on top."""
    return build_config([preset_data("paper"), {"method": "complementary"}, UNPLACED, layers])


def _shipped(*layers):
    """The paper preset's complementary run as shipped (its ``devices``), with ``layers`` on top."""
    return build_config([preset_data("paper"), {"method": "complementary"}, *layers])


def test_the_shapes_are_counted_from_the_configurations(shapes):
    a, x = shapes
    # Qwen2.5-7B: 7.616 B parameters, untied; Qwen3-4B: 4.022 B, tied; bf16 KV 56 / 144 KiB per token
    assert round(a.params / 1e9, 3) == 7.616 and round(x.params / 1e9, 3) == 4.022
    assert a.kv_bytes_per_token == 56 * 1024 and x.kv_bytes_per_token == 144 * 1024
    assert a.root_params == 2 * 152_064 * 3584 + 3584 and x.root_params == 151_936 * 2560 + 2560


def test_the_paper_preset_unplaced_is_refused_on_8_x_80_gb(shapes):
    plan = plan_memory(_paper(), 8, 79.6, *shapes)
    assert not plan.fits
    load = dict(plan.gpus[0]["load"])
    # the driver's device: fp32 actor 28.4 + its vLLM share 39.8 + fp32 extractor 15.0 = 83.2 GiB before the
    # extractor's engine starts, which then finds no free memory; GPUs 1-7 hold nothing
    assert round(load["actor float32 weights"], 1) == 28.4 and round(load["extractor float32 weights"], 1) == 15.0
    assert round(load["actor vLLM engine (0.5 of the card)"], 1) == 39.8
    assert any("extractor's vLLM engine wants 39.8 GiB" in p and "83.2 GiB of 79.6 in use" in p
               for p in plan.problems), plan.problems
    assert set(plan.gpus) == {0}
    update = dict(plan.gpus[0]["actor update"])
    assert round(update["actor AdamW moments"], 1) == 56.7 and round(update["actor gradients (float32)"], 1) == 28.4
    assert "does not fit" in format_plan(plan)
    # with the transformers engines: no vLLM share, but a full batch's key/value cache at the context
    hf = dict(plan_memory(_paper(generation={"engine": "transformers"}, extractor={"engine": "transformers"}), 8,
                          79.6, *shapes).gpus[0]["rollout"])
    assert round(hf["actor decode KV (32 rows x 32,768 tokens, bf16)"], 1) == 56.0     # 56 KiB x 32 x 32,768


def test_the_updaters_take_gpus_from_ray_without_the_drivers_and_compete(shapes):
    # workers 8: the actor's updater takes all 8 GPUs, the extractor's finds none
    plan = plan_memory(_paper(train={"workers": 8, "sharding": "fsdp"}), 8, 79.6, *shapes)
    assert any("extractor's updater asks Ray for 8 GPUs and 0 are left" in p for p in plan.problems)
    # workers 4 with fsdp: rank 0 of the actor shares GPU 0 with the driver and sets up a full replica there
    plan = plan_memory(_paper(train={"workers": 4, "sharding": "fsdp"}), 8, 79.6, *shapes)
    load0 = dict(plan.gpus[0]["load"])
    assert round(load0["actor rank setup (full float32 replica before sharding)"], 1) == 28.4
    assert set(plan.gpus) == set(range(8))
    ddp = plan_memory(_paper(train={"workers": 4, "sharding": "ddp"}), 8, 79.6, *shapes)
    assert round(dict(ddp.gpus[1]["actor update"])["actor rank states (16 B/param, ddp replica)"], 1) == 113.5


def test_vllm_refuses_a_context_its_share_cannot_hold(shapes):
    _, x = shapes
    grpo = build_config([preset_data("paper"), UNPLACED, {"method": "grpo", "generation": {"vllm_max_model_len": None},
                                                          "rollout": {"max_context_tokens": 0}}])
    # the 4B-shaped model as the actor with its own 262,144 positions: 36 GiB of KV for one sequence,
    # 0.5 x 79.6 - 7.5 - 3 GiB of room
    plan = plan_memory(grpo, 1, 79.6, x)
    assert any("one sequence of 262,144 tokens needs 36.0 GiB" in p for p in plan.problems), plan.problems
    capped = build_config([preset_data("paper"), UNPLACED, {"method": "grpo",
                                                            "generation": {"vllm_max_model_len": 32_768}}])
    assert not any("KV cache" in p for p in plan_memory(capped, 1, 79.6, x).problems)


def test_a_small_model_fits_one_card_and_a_grpo_run_has_no_extractor(tiny_model):
    small = ModelShape.from_config(tiny_model.config, "tiny")
    plan = plan_memory(build_config([{"method": "grpo"}]), 1, 79.6, small)
    assert plan.fits and set(plan.gpus[0]) == {"load", "rollout", "actor update"}
    assert "fits" in format_plan(plan)
    with pytest.raises(ValueError, match="at least one GPU"):
        plan_memory(build_config([]), 0, 79.6, small)


def test_crl_bench_plan_prints_the_budget_and_exits_3_when_it_does_not_fit(tmp_path, capsys):
    from crl_bench.cli import main

    for name, config in (("a", _qwen25_7b()), ("x", _qwen3_4b())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config.to_dict()))
    argv = ["plan", "--method", "complementary", "--preset", "paper", "--model", str(tmp_path / "a"),
            "--extractor-model", str(tmp_path / "x")]
    assert main(argv) == 0                          # the shipped layout on 8 x 80 GB
    out = capsys.readouterr().out
    assert "7.62 B parameters" in out and "GPUs 2-7 (each), actor update: 72.8 / 79.6 GiB" in out
    assert out.endswith("fits\n")
    assert main(argv + ["--gpus", "4"]) == 3        # its ranks need GPUs 2-7
    assert "devices.actor_train names GPU 4 and the machine has 4 (0 to 3)" in capsys.readouterr().out
    unplaced = [f"--set=devices.{k}=[]" for k in ("actor_engine", "extractor_engine", "actor_train",
                                                  "extractor_train")]
    unplaced += ["--set", "devices.driver=cuda", "--set", "devices.weight_sync=host", "--set", "train.workers=1",
                 "--set", "generation.vllm_gpu_memory_utilization=0.5",
                 "--set", "extractor.vllm_gpu_memory_utilization=0.5"]
    assert main(argv + unplaced) == 3
    assert "GPU 0, load: 123.0 / 79.6 GiB  OVER" in capsys.readouterr().out
    assert main(argv + unplaced + ["--gpus", "1", "--gpu-memory-gib", "2000",
                                   "--set", "generation.vllm_gpu_memory_utilization=0.1",
                                   "--set", "extractor.vllm_gpu_memory_utilization=0.1"]) == 0


def test_the_shipped_paper_layout_fits_8_x_80_gb_and_says_where_each_role_is(shapes):
    plan = plan_memory(_shipped(), 8, 79.6, *shapes)
    assert plan.fits, plan.problems
    # the driver keeps its float32 weights in host memory: no GPU holds them
    assert not any("float32 weights" in label for by in plan.gpus.values() for items in by.values()
                   for label, _ in items)
    # GPU 0 the actor's engine alone, GPU 1 the extractor's, each at 0.9 of the card in every phase; in its
    # sync (devices.weight_sync: direct) each also receives one tensor at a time: at most the 7B's embedding
    for gpu, who, embedding in ((0, "actor", 1.0), (1, "extractor", 0.7)):
        assert {label for phase, items in plan.gpus[gpu].items() if phase != f"{who} sync" for label, _ in items} == \
            {f"{who} vLLM engine (0.9 of the card)"}
        assert round(plan.total(gpu, "rollout"), 1) == 71.6
        assert round(dict(plan.gpus[gpu][f"{who} sync"])[f"{who} weight arriving (largest tensor, bf16)"], 1) == \
            embedding
    # the ranks gather each tensor whole for the channel, rank 0 casting it: far under the update's peak
    gathered = dict(plan.gpus[2]["actor sync"])["actor tensor gathered for the engine (largest, float32 + bf16)"]
    assert round(gathered, 1) == 3.0 and plan.total(2, "actor sync") < plan.total(2, "actor update")
    # GPUs 2-7: both updaters' ranks, six-way sharded; the actor's update is the peak
    for gpu in range(2, 8):
        update = dict(plan.gpus[gpu]["actor update"])
        assert round(update["actor rank states (16 B/param, 1/6 sharded, root whole)"], 1) == 32.4
        assert round(update["extractor rank states (16 B/param, 1/6 sharded, root whole)"], 1) == 14.8
        assert round(update["actor rank log-probs (32,768 tokens)"], 1) == 19.4
        assert round(plan.total(gpu, "actor update"), 1) == 72.8
        # the extractor's micro-batches take the same token bound as the actor's (train.micro_batch_tokens)
        assert "extractor rank log-probs (32,768 tokens)" in dict(plan.gpus[gpu]["extractor update"])
    # on 40 GB cards the same layout is refused, GPU by GPU
    small = plan_memory(_shipped(), 8, 39.6, *shapes)
    assert not small.fits and any(p.startswith("GPU 0, load: the actor's vLLM engine has") or
                                  p.startswith("GPU 2, actor update") for p in small.problems), small.problems


def test_a_sleeping_engine_leaves_its_gpu_to_the_ranks_during_the_actor_update(shapes):
    colocated = {"devices": {"actor_engine": [2], "weight_sync": "host"},
                 "generation": {"vllm_gpu_memory_utilization": 0.4,
                                                                 "vllm_sleep": True}}
    plan = plan_memory(_shipped(colocated), 8, 79.6, *shapes)
    labels = {ph: [label for label, _ in items] for ph, items in plan.gpus[2].items()}
    assert "actor vLLM engine (0.4 of the card)" in labels["rollout"]
    assert "actor vLLM engine (0.4 of the card)" in labels["extractor update"]      # awake again after the sync
    assert not any("vLLM" in label for label in labels["actor update"])
    awake = plan_memory(_shipped(colocated, {"generation": {"vllm_sleep": False}}), 8, 79.6, *shapes)
    assert any(p.startswith("GPU 2, actor update") for p in awake.problems), awake.problems


def test_the_released_16_gpu_split_is_expressible(shapes):
    # released: actor training and inference on GPUs 0-7, the extractor's vLLM on 8-15 (here with its ranks)
    released = {"train": {"workers": 8},
                "devices": {"actor_engine": list(range(8)), "actor_train": list(range(8)),
                            "extractor_engine": list(range(8, 16)), "extractor_train": list(range(8, 16)),
                            "weight_sync": "host"},     # colocated: rank 0 shares a GPU with the engine
                "generation": {"vllm_gpu_memory_utilization": 0.6, "vllm_sleep": True},
                "extractor": {"vllm_gpu_memory_utilization": 0.5}}
    plan = plan_memory(_shipped(released), 16, 79.6, *shapes)
    assert plan.fits, plan.problems
    assert "actor vLLM engine (0.6 of the card, tensor parallel 8)" in dict(plan.gpus[5]["rollout"])
    assert set(plan.gpus) == set(range(16))
    assert not plan_memory(_shipped(released), 8, 79.6, *shapes).fits     # 8 GPUs do not have GPUs 8-15


def test_run_refuses_a_layout_that_does_not_fit_before_loading(monkeypatch, tmp_path, tiny_model):
    # a CUDA machine stand-in with one 1 GiB card: the plan is checked in the preflight, before any model loads
    import torch

    from crl_bench.config import ConfigError
    from crl_bench.trainer import lifecycle, memory_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": GIB // 8})())
    small = ModelShape.from_config(tiny_model.config, "tiny")
    monkeypatch.setattr(memory_plan, "shapes_for", lambda cfg: (small, None))
    cfg = build_config([{"method": "grpo", "output_dir": str(tmp_path / "runs")}])
    with pytest.raises(ConfigError, match="does not fit this machine's GPUs"):
        lifecycle.preflight(cfg)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * GIB})())
    lifecycle.preflight(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_lora_run_counts_no_actor_optimizer_state_and_an_adapter_folder_is_its_base(tiny_model_dir, tmp_path):
    base = ModelShape.of(str(tiny_model_dir))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    assert ModelShape.of(str(adapter)).params == base.params
    plan = plan_memory(build_config([{"method": "grpo", "model": {"lora": True}}]), 1, 79.6, base)
    labels = [label for label, _ in plan.gpus[0]["actor update"]]
    assert not any("AdamW" in x or "gradients" in x for x in labels) and any("log-probs" in x for x in labels)
