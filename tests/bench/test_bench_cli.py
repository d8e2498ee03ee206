"""``crl-bench bench NAME``: the benchmark registry (crl_bench/bench/) builds the subcommands, each with
its own options and the defaults the single ``bench`` parser had; no benchmark runs here (the figures
are faked), only what each subcommand passes on and prints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from crl_bench import bench
from crl_bench.cli import build_parser, main


def test_registry_lists_every_benchmark_with_its_entry_points():
    assert list(bench.BENCHMARKS) == ["env", "rollout", "retrieval", "overhead", "step", "update", "dp", "backend",
                                      "eval", "roofline", "memory", "update-peak", "weight-sync",
                                      "checkpoint-io"]
    for name in bench.BENCHMARKS:
        mod = bench.benchmark(name)
        assert callable(mod.add_parser) and callable(mod.run) and mod.HELP, name
        assert mod.__doc__ and mod.add_parser.__doc__ and mod.run.__doc__, name
    with pytest.raises(KeyError, match="unknown benchmark 'nope'"):
        bench.benchmark("nope")


@pytest.mark.parametrize("argv, expected", [
    (["env"], {"env": None, "steps": 2000, "workers": 2, "episodes": None, "seed": 0, "chunk": 100,
               "warmup": 50, "json": False}),
    (["env", "--env", "alfworld", "--env", "sokoban", "--workers", "3", "--episodes", "4", "--steps", "9"],
     {"env": ["alfworld", "sokoban"], "workers": 3, "episodes": 4, "steps": 9}),
    (["rollout"], {"env": None, "envs": 8, "max_steps": 4, "model": "smollm2-135m-instruct"}),
    (["rollout", "--env", "sokoban", "--envs", "2", "--max-steps", "1", "--model", "m"],
     {"env": ["sokoban"], "envs": 2, "max_steps": 1, "model": "m"}),
    (["overhead"], {"env": None, "envs": 8, "max_steps": 4, "model": "smollm2-135m-instruct"}),
    (["step"], {"env": None, "mix": None, "preset": "smoke", "train_steps": 2, "no_update_probe": False,
                "model": "smollm2-135m-instruct"}),
    (["step", "--mix", "3task", "--preset", "cpu", "--train-steps", "5", "--no-update-probe"],
     {"mix": "3task", "preset": "cpu", "train_steps": 5, "no_update_probe": True}),
    (["dp"], {"model": "smollm2-135m-instruct", "workers": 2, "sharding": "ddp", "groups": 4, "group_size": 4,
              "prompt_tokens": 256, "response_tokens": 32, "micro_batch_size": 4, "repeats": 3, "threads": 0,
              "sequential": False}),
    (["dp", "--workers", "3", "--sharding", "fsdp", "--repeats", "1", "--sequential"],
     {"workers": 3, "sharding": "fsdp", "repeats": 1, "sequential": True, "gpus": None}),
    (["dp", "--workers", "2", "--gpus", "3,5"], {"workers": 2, "gpus": [3, 5]}),
    (["update-peak"], {"shape": "qwen2.5-7b", "layers": [1, 2], "tokens": 4096, "device": "cuda", "check": False}),
    (["update-peak", "--shape", "qwen3-4b", "--layers", "2", "4", "--tokens", "8192", "--check"],
     {"shape": "qwen3-4b", "layers": [2, 4], "tokens": 8192, "check": True}),
    (["weight-sync"], {"model": "smollm2-135m-instruct", "workers": 2, "sharding": "fsdp", "repeats": 3,
                       "dtype": "float32", "gpus": None, "engine_gpus": None}),
    (["weight-sync", "--workers", "3", "--dtype", "bfloat16", "--gpus", "1,2,3", "--engine-gpus", "0"],
     {"workers": 3, "dtype": "bfloat16", "gpus": [1, 2, 3], "engine_gpus": [0]}),
    (["checkpoint-io"], {"gib": 1.0, "dir": None, "steps": 512, "every": 100, "check": False}),
    (["checkpoint-io", "--gib", "0.5", "--dir", "/d", "--every", "10", "--check"],
     {"gib": 0.5, "dir": "/d", "every": 10, "check": True}),
    (["retrieval"], {"sizes": [1000, 10000, 100000], "index": ["flat", "ivf", "hnsw"],
                     "data": ["sentence", "gaussian"], "vectors": None, "queries": 64, "recall_queries": 256,
                     "k": 16, "dim": 384, "repeats": 5, "latency_samples": 512, "seed": 0, "search_threads": 1}),
    (["retrieval", "--sizes", "300", "--index", "flat", "auto", "--k", "5", "--search-threads", "2"],
     {"sizes": [300], "index": ["flat", "auto"], "k": 5, "search_threads": 2}),
])
def test_each_subcommand_parses_its_options(argv, expected):
    args = build_parser().parse_args(["bench", *argv])
    assert args.name == argv[0]
    assert {k: getattr(args, k) for k in expected} == expected


def test_an_option_of_another_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "retrieval", "--no-such-option"])
    assert e.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_rollout_overhead_step_pass_their_options_and_print(monkeypatch, capsys):
    from crl_bench.bench import overhead, rollout, step

    seen = {}
    arm = {"tokens": 12, "generate_s": 1.5, "wall_s": 2.0, "tokens_per_s": 8.0}
    monkeypatch.setattr(rollout, "bench_rollout", lambda *a: seen.setdefault("rollout", a) and {
        "envs": 3, "max_steps": 2, "threads": 2, "dtype": "float32", "tokens_per_s_ratio": 1.5,
        "tokens_per_s_ratio_vs_naive": 2.5, **{n: arm for n in rollout.ARMS}})
    assert main(["bench", "rollout", "--env", "sokoban", "--envs", "3", "--max-steps", "2"]) == 0
    assert seen["rollout"] == ("smollm2-135m-instruct", "sokoban", 3, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "rollout bench: sokoban, 3 episodes x up to 2 actions, 2 torch threads, compute dtype float32"
    assert out[-2:] == ["tokens/s ratio, batched / one env at a time (same engine): 1.50x",
                        "tokens/s ratio, batched / naive one env at a time (no prefix cache): 2.50x"]

    monkeypatch.setattr(rollout, "bench_engines", lambda *a, **k: seen.setdefault("engines", (a, k)) and {
        "envs": 3, "max_steps": 2, "repeats": 2, "threads": 2, "dtype": "bfloat16", "device": "cuda",
        "vllm_backend": "gpu", "sync_s": 0.25, "tokens_per_s_ratio": 3.0, "tokens_per_s_ratio_with_sync": 2.5,
        **{n: arm for n in rollout.ENGINE_ARMS}})
    assert main(["bench", "rollout", "--engine", "vllm", "--env", "sokoban", "--envs", "3", "--max-steps", "2",
                 "--dtype", "bfloat16"]) == 0
    assert seen["engines"] == (("smollm2-135m-instruct", "sokoban", 3, 2), {"repeats": 2, "dtype": "bfloat16"})
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["engine", "tokens", "generate", "s", "wall", "s", "tok/s"]
    assert out[-2:] == ["weight sync into vLLM: 0.25 s each",
                        "tokens/s ratio, vllm / transformers: 3.00x (2.50x counting one weight sync per rollout)"]

    monkeypatch.setattr(overhead, "bench_overhead", lambda *a, **k: seen.setdefault("overhead", (a, k)) and {
        "episodes_per_round": 4, "rounds": 2, "max_steps": 3, "bank_size": 7,
        "wall_s": {"grpo": 1.0, "complementary": 1.2, "grpo+guidance": 1.1, "complementary+distill": 1.5},
        "ratio": 1.2, "ratio_with_distill": 1.5,
        "gate": {"actor_waited_s": 0.1, "distill_waited_s": 0.2, "drain_after_s": 0.3},
        "distill_backlog_after_last_round": 0, "prompt_ratio": 1.1, "mechanism_ratio": 1.5 / 1.1})
    assert main(["bench", "overhead", "--envs", "5", "--max-steps", "3"]) == 0
    assert seen["overhead"] == (("smollm2-135m-instruct", "minihack-room"),
                                {"groups": 2, "group_size": 2, "max_steps": 3})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "overhead bench: minihack-room, 4 episodes x up to 3 actions, 2 rounds, bank of 7 entries"
    assert out[5] == "ratio complementary / grpo: 1.200 (retrieval + guided prompts)"
    assert out[-1] == ("split: guided prompts (grpo+guidance / grpo) 1.100; experience mechanism "
                       "(complementary+distill / grpo+guidance: retrieval, queueing, waits) 1.364")

    monkeypatch.setattr(step, "bench_step", lambda *a, **k: seen.setdefault("step", (a, k)) and {})
    monkeypatch.setattr(step, "format_step", lambda res: "step table")
    assert main(["bench", "step", "--env", "sokoban", "--train-steps", "3", "--no-update-probe"]) == 0
    assert seen["step"] == (("smollm2-135m-instruct", "sokoban", "smoke", 3),
                            {"overrides": None, "update_probe": False})
    assert capsys.readouterr().out == "step table\n"
    seen.clear()
    assert main(["bench", "step", "--env", "sokoban", "--prompt", "multiturn", "--max-actions", "12"]) == 0
    assert seen["step"][1] == {"overrides": {"rollout": {"prompt": "multiturn", "max_steps": 12}}, "update_probe": True}


def test_rollout_and_step_print_each_arm_as_a_share_of_the_roofline(monkeypatch, capsys):
    from crl_bench.bench import rollout, step

    roof = {"prefill": {"tok_s": 800.0, "batch": 3, "prompt": 512}, "matmul_flop_s": 4e11, "flops_per_token": 2.7e8,
            "decode": [{"batch": 1, "tok_s": 20.0, "context": 300}, {"batch": 3, "tok_s": 50.0, "context": 300}],
            "train": {"tok_s": 300.0, "rows": 4, "length": 576, "checkpointing": True, "compute_bound_tok_s": 900.0}}
    arms = {n: {"tokens": 12, "generate_s": 1.5, "wall_s": 2.0, "tokens_per_s": 8.0, "share_of_pure": 0.5 + i / 10,
                "share_of_matmul": 0.01 * (i + 1)} for i, n in enumerate(rollout.ARMS)}
    monkeypatch.setattr(rollout, "bench_rollout", lambda *a: {
        "envs": 3, "max_steps": 2, "threads": 2, "dtype": "bfloat16", "tokens_per_s_ratio": 1.5,
        "tokens_per_s_ratio_vs_naive": 2.5, "roofline": roof, **arms})
    assert main(["bench", "rollout", "--envs", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-4:] == ["of", "pure", "of", "matmul"]
    assert out[2].split()[-2:] == ["50.0%", "1.0%"] and out[4].split()[-2:] == ["70.0%", "3.0%"]
    assert out[5].startswith("roofline (bfloat16): pure torch prefill 800 tok/s, decode 20 at batch 1, 50 at batch 3")

    a = {"generated_tokens": 10, "prefill_tokens": 20, "prompt_tokens": 30, "tokens_per_s": 5.0, "step_s_mean": 2.0,
         "rollout_s_mean": 1.0, "update_s_mean": 1.0, "update_s_per_1k_tokens": 100.0}
    res = {"mix": "m", "preset": "smoke", "steps": 1, "threads": 2, "dtype": {"before": "float32", "after": "bfloat16"},
           "before": {**a, "share_of_pure": 0.25, "share_of_matmul": 0.02},
           "after": {**a, "share_of_pure": 0.5, "share_of_matmul": 0.04}, "roofline": roof,
           "pure": {"prefill_tok_s": 800.0, "decode_tok_s": 50.0, "batch": 3, "prefill_batch": 3, "prompt": 512,
                    "context": 300},
           "ratios": {"tokens_per_s": 1.0, "step_s": 1.0, "rollout_s": 1.0}}
    lines = step.format_step(res).splitlines()
    assert lines[1].split()[-4:] == ["of", "pure", "of", "matmul"]
    assert lines[2].split()[-2:] == ["25.0%", "2.0%"] and lines[3].split()[-2:] == ["50.0%", "4.0%"]
    assert lines[5].startswith("matmul limit (bfloat16): 400 GFLOP/s, 0.270 GFLOP per generated token")
    assert lines[6].startswith("pure torch forward+backward: 300 tok/s (4 x 576 tokens, with checkpointing")


def test_env_bench_runs_the_own_benches_of_named_envs(monkeypatch, capsys):
    from crl_bench.bench import alfworld, env, webshop

    seen = []
    monkeypatch.setattr(alfworld, "bench_alfworld", lambda **k: seen.append(("alfworld", k)) or "A")
    monkeypatch.setattr(alfworld, "format_result", lambda r: "alfworld lines")
    monkeypatch.setattr(webshop, "bench_webshop", lambda **k: seen.append(("webshop", k)) or "W")
    monkeypatch.setattr(webshop, "format_result", lambda r: "webshop lines")
    monkeypatch.setattr(env, "bench_env", lambda *a, **k: seen.append(("env", a)) or [])
    # alfworld's bench first, then webshop's, then the others' table, whatever the order named
    assert main(["bench", "env", "--env", "webshop", "--env", "alfworld", "--workers", "3"]) == 0
    assert seen == [("alfworld", {"workers": 3, "episodes": 8}), ("webshop", {"episodes": 200})]
    assert capsys.readouterr().out == "alfworld lines\nwebshop lines\n"
    seen.clear()
    assert main(["bench", "env", "--env", "webshop", "--env", "sokoban", "--episodes", "5"]) == 0
    assert seen == [("webshop", {"episodes": 5}), ("env", (["sokoban"], 2000, 0))]


def test_python_m_crl_bench_bench_is_the_cli():
    r = subprocess.run([sys.executable, "-m", "crl_bench.bench", "retrieval", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: crl-bench bench retrieval" in r.stdout and "--search-threads" in r.stdout


def test_building_the_parser_imports_no_benchmark_engine():
    """The parser is built on every ``crl-bench`` call: the benchmark modules import torch, FAISS, the
    trainer and the envs only when a benchmark runs."""
    code = ("import sys; from crl_bench.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'faiss', 'transformers', 'crl_bench.trainer.loop', "
            "'crl_bench.experience.bank', 'crl_bench.envs.minihack') if m in sys.modules]; "
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_rollout_decode_passes_batches_and_prints_each_arm(monkeypatch, capsys):
    """``bench rollout --decode --batches 8,32``: the batch list reaches bench_decode, and each batch gets
    one row per arm (tok/s over generate's, shares of pure torch and of matmul), then the calls and the
    roofline's rates; a bad batch list is a usage error."""
    from crl_bench.bench import rollout

    seen = {}
    arm = {"tokens": 10, "prefill_tokens": 100, "prefill_positions": 120,
           "generate_s": 2.0, "tokens_per_s": 5.0, "share_of_pure": 0.5,
           "share_of_matmul": 0.04}
    roof = {"prefill": {"tok_s": 800.0, "prompt": 128}, "decode": [{"tok_s": 80.0, "context": 300}],
            "matmul_flop_s": 4e11}
    row = {"roofline": roof, "context": 300, "calls": 4,
           "mismatches": 0, "ratio": dict.fromkeys(rollout.DECODE_ARMS, 1.0), **dict.fromkeys(rollout.DECODE_ARMS, arm)}
    monkeypatch.setattr(rollout, "bench_decode", lambda *a, **k: seen.setdefault("decode", (a, k)) and {
        "max_steps": 2, "repeats": 3, "temperature": 0.0, "threads": 2, "dtype": "bfloat16",
        "batches": {8: row, 32: row}})
    assert main(["bench", "rollout", "--decode", "--batches", "8,32", "--max-steps", "2"]) == 0
    assert seen["decode"][0][2] == (8, 32) and seen["decode"][1]["repeats"] == 3
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[:2] for ln in out[2:5]] == [["8", name] for name in rollout.DECODE_ARMS]
    assert out[2].split()[-3:] == ["1.00x", "50.0%", "4.0%"]
    assert "replies differing from generate's: 0" in out[5]
    with pytest.raises(SystemExit) as e:
        main(["bench", "rollout", "--decode", "--batches", "8,x"])
    assert e.value.code == 2


def test_weight_sync_prints_both_arms_and_fails_when_the_engine_serves_other_weights(monkeypatch, capsys):
    from crl_bench.bench import weight_sync

    res = {"model": "m", "workers": 2, "sharding": "fsdp", "dtype": "float32", "params": 135e6, "backend": "gloo",
           "host_s": [7.0, 8.0], "direct_s": [5.0, 6.0], "host_mean_s": 7.5, "direct_mean_s": 5.5,
           "ratio": 7.5 / 5.5, "host_bytes": 135e6 * 8, "direct_bytes": 135e6 * 4, "max_logprob_diff": 2e-5,
           "passed": True}
    seen = {}
    monkeypatch.setattr(weight_sync, "bench_weight_sync", lambda *a: seen.setdefault("args", a) and res)
    assert main(["bench", "weight-sync", "--repeats", "2"]) == 0
    assert seen["args"] == ("smollm2-135m-instruct", 2, "fsdp", 2, "float32", None, None)
    out = capsys.readouterr().out
    assert "host / direct: 1.36x (faster direct)" in out and "host 1.01 GiB, direct 0" in out and "PASS" in out
    res.update(max_logprob_diff=0.5, passed=False)
    assert main(["bench", "weight-sync"]) == 1
    assert "FAIL" in capsys.readouterr().out
