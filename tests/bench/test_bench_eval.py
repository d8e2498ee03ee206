"""``crl-bench bench eval`` on the tiny random model: both arms (per-mode waves, one stream) evaluate the
same tasks, and the table gives each arm's episodes, tokens and share of the roofline, the ratio and how
many episodes the arms played alike."""

from __future__ import annotations

from crl_bench.cli import main


def test_bench_eval_runs_both_arms_on_the_tiny_model(tiny_model_dir, capsys, monkeypatch):
    from crl_bench.bench import roofline

    # the roofline's forwards (seconds on any model) are not what is tested: fixed rates stand in
    roof = {"prefill": {"tok_s": 1000.0}, "decode": [{"batch": 8, "tok_s": 100.0}], "matmul_flop_s": 1e11,
            "flops_per_token": 1e6, "flops_per_prefill_token": 1e6}
    monkeypatch.setattr(roofline, "measure_roofline", lambda *a, **k: roof)
    argv = ["bench", "eval", "--model", str(tiny_model_dir), "--mix", "sokoban", "--preset", "smoke",
            "--episodes", "3", "--max-concurrent", "2", "--max-actions", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("eval bench: sokoban / preset smoke, method grpo, modes free, 3 tasks per env")
    rows = {line.split()[0]: line.split() for line in out
            if line.split()[:1] in (["waves"], ["stream"]) and line.split()[1].isdigit()}
    assert rows["waves"][1] == rows["stream"][1] == "3"              # episodes of each arm
    assert rows["waves"][4] == rows["stream"][4]                     # same generated tokens (greedy, same replies)
    assert float(rows["stream"][7]) >= float(rows["waves"][7])      # turns per generate: the slots are fuller
    assert out[-2].startswith("stream / waves: ") and out[-1].endswith(" of 3")
    assert any(line.startswith("roofline (") for line in out)
    header = next(line for line in out if line.startswith("arm "))
    assert header.split()[-4:] == ["of", "pure", "of", "matmul"]
    assert main([*argv, "--modes", "guided"]) == 2                  # grpo has no bank: one line, exit 2
    assert "needs an experience bank" in capsys.readouterr().err
    assert main([*argv, "--method", "nope"]) == 2
