"""The OpenAI-compatible engine (crl_bench/llm/openai_engine.py) against a stand-in client: what it sends,
how it reads replies (stop strings, finish reasons, usage), its concurrency limit, and the settings it
refuses. The real server is in test_openai_served.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from crl_bench.cli import main
from crl_bench.config import ConfigError, build_config, preset_data
from crl_bench.llm.base import SamplingParams
from crl_bench.llm.openai_engine import OpenAIEngine


class _Tok:
    """Counts characters as tokens."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class _Client:
    """Answers every request with ``reply`` (finish ``finish``, ``stop_reason`` when given), records the
    requests and the most requests in flight at once."""

    def __init__(self, reply="up", finish="stop", extra=None, delay=0.0):
        self.reply, self.finish, self.extra, self.delay = reply, finish, extra, delay
        self.sent: list[dict] = []
        self.live = self.most = 0
        self._lock = threading.Lock()
        self.completions = SimpleNamespace(create=self._create)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **kw):
        with self._lock:
            self.sent.append(kw)
            self.live += 1
            self.most = max(self.most, self.live)
        time.sleep(self.delay)
        with self._lock:
            self.live -= 1
        extra = {} if self.extra is None else self.extra
        choice = SimpleNamespace(text=self.reply, message=SimpleNamespace(content=self.reply),
                                 finish_reason=self.finish, model_extra=extra, **extra)
        return SimpleNamespace(choices=[choice], usage=SimpleNamespace(prompt_tokens=10, completion_tokens=3))


def _engine(client, **kw):
    return OpenAIEngine(_Tok(), "http://127.0.0.1:1/v1", "served-model", client=client, **kw)


def test_completions_send_the_token_ids_and_keep_the_matched_stop_string():
    client = _Client(reply="up", extra={"stop_reason": "</answer>"})
    eng = _engine(client)
    gens = eng.generate([[1, 2, 3], [4]], SamplingParams(temperature=0, max_new_tokens=7, stop=("</answer>", "\n")))
    assert [g.text for g in gens] == ["up</answer>", "up</answer>"]
    assert gens[0].finish_reason == "stop" and gens[0].prompt_ids == [1, 2, 3]
    assert gens[0].response_ids == [ord(c) for c in "up</answer>"]
    assert client.sent[0] == {"model": "served-model", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0,
                              "top_p": 1.0, "stop": ["</answer>", "\n"]}       # no top_k unless asked for
    assert eng.stats.summary()["requests"] == 2 and eng.stats.prompt_tokens == 20
    assert eng.stats.completion_tokens == 6


def test_eos_length_and_a_server_that_does_not_say_which_stop_matched():
    eos = _engine(_Client(reply="up", extra={"stop_reason": None})).generate([[1]], SamplingParams())[0]
    assert (eos.text, eos.finish_reason) == ("up", "eos")
    cut = _engine(_Client(reply="u", finish="length")).generate([[1]], SamplingParams())[0]
    assert (cut.text, cut.finish_reason) == ("u", "length")
    plain = _engine(_Client(reply="up")).generate([[1]], SamplingParams(stop=("</answer>",)))[0]
    assert plain.text == "up</answer>"      # one stop string: the one that matched
    top_k = _Client()
    _engine(top_k).generate([[1]], SamplingParams(top_k=5))
    assert top_k.sent[0]["extra_body"] == {"top_k": 5}


def test_chat_sends_the_episode_messages():
    client = _Client(reply="<answer>up</answer>")
    chats = [[{"role": "system", "content": "rules"}, {"role": "user", "content": "obs"}]]
    gen = _engine(client, api="chat").generate([[1]], SamplingParams(stop=()), chats=chats)[0]
    assert client.sent[0]["messages"] == chats[0] and "prompt" not in client.sent[0]
    assert gen.text == "<answer>up</answer>"
    with pytest.raises(ValueError, match="messages"):
        _engine(client, api="chat").generate([[1]], SamplingParams())


def test_requests_run_at_most_concurrency_at_once_in_order():
    client = _Client(delay=0.05)
    gens = _engine(client, concurrency=3).generate([[i] for i in range(12)], SamplingParams())
    assert client.most == 3 and [g.prompt_ids for g in gens] == [[i] for i in range(12)]


def test_constrained_prompts_and_training_are_refused():
    eng = _engine(_Client())
    with pytest.raises(ValueError, match="constrained=false"):
        eng.generate([[1]], SamplingParams(), allowed=[["up", "down"]])
    with pytest.raises(RuntimeError, match="cannot follow trained weights"):
        eng.sync_weights(object())


def _cfg(**generation):
    return build_config([preset_data("smoke"), {"rollout": {"mix": "sokoban"}, "generation": generation}])


def test_the_config_names_what_the_openai_engine_needs():
    ok = {"engine": "openai", "openai_base_url": "http://x/v1", "openai_model": "m", "constrained": False}
    assert _cfg(**ok).generation.openai_api == "completions"
    with pytest.raises(ConfigError, match="generation.openai_model must be set"):
        _cfg(**{**ok, "openai_model": ""})
    with pytest.raises(ConfigError, match="generation.constrained must be false"):
        _cfg(**{**ok, "constrained": True})
    with pytest.raises(ConfigError, match="generation.prefill must be empty"):
        _cfg(**{**ok, "openai_api": "chat"})
    assert _cfg(**{**ok, "openai_api": "chat", "prefill": ""}).generation.prefill == ""
    with pytest.raises(ConfigError, match="openai_api"):
        _cfg(**{**ok, "openai_api": "responses"})


def test_run_refuses_to_train_through_a_served_model(tmp_path, capsys):
    rc = main(["run", "--mix", "sokoban", "--preset", "smoke", "--output-dir", str(tmp_path), "--set",
               "generation.engine=openai", "--set", "generation.openai_base_url=http://127.0.0.1:1/v1",
               "--set", "generation.openai_model=m", "--set", "generation.constrained=false"])
    assert rc == 2 and "cannot train" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_eval_flags_of_a_served_model_are_checked(capsys):
    assert main(["eval", "--mix", "sokoban", "--engine", "openai", "--model", "m"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["eval", "--mix", "sokoban", "--base-url", "http://x/v1"]) == 2
    assert "go with --engine openai" in capsys.readouterr().err
