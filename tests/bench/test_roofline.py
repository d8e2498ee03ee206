"""``crl-bench bench roofline`` (crl_bench/bench/roofline.py): the measurements' structure and sanity on a
tiny model (positive rates, FLOPs counted from the model's linear layers, a share of 1 for a generation
exactly as fast as the pure-torch forwards), and the command line's options, table and errors."""

from __future__ import annotations

import json

import pytest
import torch

from crl_bench.bench import roofline
from crl_bench.cli import build_parser, main

#: sizes small enough for the whole measurement to take well under a second in float32
FAST = dict(batches=(1, 4), prompt=32, context=16, decode_steps=4, train_tokens=64, train_length=32,
            train_response=8, square=64, bandwidth_mib=1, min_seconds=0.005)


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def roof():
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = roofline.measure_roofline(model, torch.float32, **FAST)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the weights changed"
    return res


def test_measures_every_limit_with_positive_rates(roof):
    assert roof["dtype"] == "float32" and roof["device"] == "cpu" and roof["threads"] >= 1
    assert roof["torch"] == torch.__version__ and roof["cpu"] and isinstance(roof["cpu_bf16_units"], list)
    names = [r["name"] for r in roof["matmul"]]
    assert names == ["mlp up, decode 1", "mlp up, decode 4", "lm head, decode 1", "lm head, decode 4",
                     "mlp up, prefill 1x32", "lm head, 32 rows", "square 64"]
    assert all(r["flop_s"] > 0 for r in roof["matmul"])
    assert roof["matmul_flop_s"] == max(r["flop_s"] for r in roof["matmul"])
    assert roof["bandwidth"]["copy_gb_s"] > 0 and roof["bandwidth"]["add_gb_s"] > 0
    assert roof["prefill"]["batch"] == 1 and roof["prefill"]["tok_s"] > 0
    assert [d["batch"] for d in roof["decode"]] == [1, 4]
    for d in roof["decode"]:
        assert min(d["tok_s"], d["compute_bound_tok_s"], d["weights_kv_bound_tok_s"]) > 0
        assert d["weights_kv_bound_tok_s"] < d["weights_bound_tok_s"]      # the cache costs bytes too
    t = roof["train"]
    assert t["rows"] == 2 and t["length"] == 32 and t["logits_kept"] == 9 and t["checkpointing"]
    assert t["tok_s"] > 0 and t["compute_bound_tok_s"] > 0


def test_flops_count_the_linear_layers_the_lm_head_and_attention(roof):
    m = roof["model"]
    layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128      # q, k, v, o (2 kv heads), gate/up/down
    assert m["body_params"] == 2 * layer and m["head_params"] == 512 * 64     # tied: the head counts
    assert m["attention_flops_per_context"] == 4 * 2 * 4 * 16
    assert roof["flops_per_token"] == 2 * (2 * layer + 512 * 64) + 4 * 2 * 4 * 16 * 16
    assert roof["weight_bytes"] == (2 * layer + 512 * 64) * 4
    assert roof["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4           # K and V, 2 layers, 2 kv heads x 16, fp32
    # forward + backward of the body and the kept logits, and the checkpointed body's second forward
    fwd = 2 * 2 * layer + 4 * 2 * 4 * 16 * 33 / 2 + 2 * 512 * 64 * 9 / 32
    assert roof["train"]["flops_per_token"] == pytest.approx(3 * fwd + 2 * 2 * layer)


def test_a_generation_as_fast_as_pure_torch_is_a_share_of_one(roof):
    prefill, d4 = roof["prefill"]["tok_s"], roof["decode"][1]["tok_s"]
    share = roofline.roofline_share(roof, prefill_tokens=round(prefill), generated_tokens=round(2 * d4),
                                    seconds=3.0, batch=3)               # 1 s of prefill, 2 s of decode at 4
    assert share["batch"] == 4
    assert share["share_of_pure"] == pytest.approx(1.0, rel=0.01)
    flops = round(prefill) * roof["flops_per_prefill_token"] + round(2 * d4) * roof["flops_per_token"]
    assert share["share_of_matmul"] == pytest.approx(flops / (3.0 * roof["matmul_flop_s"]))
    assert 0 < share["share_of_matmul"] < float("inf")
    slower = roofline.roofline_share(roof, prefill_tokens=round(prefill), generated_tokens=round(2 * d4),
                                     seconds=6.0, batch=4)
    assert slower["share_of_pure"] == pytest.approx(0.5, rel=0.01)
    assert roofline.roofline_share(roof, prefill_tokens=0, generated_tokens=10, seconds=1.0,
                                   batch=1)["batch"] == 1
    fastest = max(roof["decode"], key=lambda r: r["tok_s"])["batch"]
    assert roofline.roofline_share(roof, prefill_tokens=0, generated_tokens=10, seconds=1.0)["batch"] == fastest
    with pytest.raises(ValueError, match="seconds > 0"):
        roofline.roofline_share(roof, prefill_tokens=1, generated_tokens=1, seconds=0.0)


def test_the_table_names_the_machine_and_each_limit(roof):
    text = roofline.format_roofline(roof, "tiny")
    assert text.startswith("roofline: tiny in float32 on cpu (")
    for needle in ("square 64", "memory bandwidth: copy", "prefill 1 x 32", "decode 4 @ 16", "fwd+bwd 2 x 32"):
        assert needle in text
    assert roof["load"]["cpus"] >= 1
    busy = roofline.format_roofline({**roof, "load": {"start": 3.2, "end": 5.0, "cpus": 2}})
    assert busy.splitlines()[-1] == ("load average 3.2 at the start, 5.0 at the end, 2 CPUs; other processes "
                                     "shared the cores: the rates are lower than alone")
    alone = roofline.format_roofline({**roof, "load": {"start": 0.9, "end": 2.1, "cpus": 2}})
    assert alone.splitlines()[-1] == "load average 0.9 at the start, 2.1 at the end, 2 CPUs"


def test_the_command_passes_its_options_prints_and_writes_json(monkeypatch, capsys, tmp_path, roof):
    from crl_bench.llm import hf_engine

    seen = {}
    monkeypatch.setattr(hf_engine, "load_model_and_tokenizer", lambda name: (_tiny(), None))
    monkeypatch.setattr(roofline, "measure_roofline", lambda m, d, **k: seen.update(dtype=d, **k) or roof)
    out = tmp_path / "roof.json"
    assert main(["bench", "roofline", "--model", "tiny", "--batches", "2,16", "--dtype", "float32",
                 "--threads", "1", "--json", str(out)]) == 0
    assert seen == {"dtype": torch.float32, "batches": [2, 16], "train_tokens": 2304, "checkpointing": True}
    assert capsys.readouterr().out.startswith("roofline: tiny in float32")
    assert json.loads(out.read_text())["model_name"] == "tiny"
    assert main(["bench", "roofline", "--json", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert capsys.readouterr().err.startswith("crl-bench: error: cannot write ")


@pytest.mark.parametrize("argv", [["--batches", "8,x"], ["--batches", "0"], ["--dtype", "float16"],
                                  ["--threads", "-1"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "roofline", *argv])
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_defaults():
    args = build_parser().parse_args(["bench", "roofline"])
    assert (args.model, args.batches, args.dtype, args.threads, args.json) == (
        "smollm2-135m-instruct", [8, 32, 64], "auto", 0, None)
