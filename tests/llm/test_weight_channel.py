"""The weight channel (crl_bench/llm/weight_channel.py) over gloo, both ends in threads of this process:
what the sender's parameters are is what the receiver gets, in the engine's dtype and in order; a rank
without the channel only takes part in gathers; bad arguments are refused. The whole path from FSDP ranks
into a real vLLM engine is tests/llm/test_vllm_real.py."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from crl_bench.llm.weight_channel import open_channel, receive_parameters, send_parameters


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*targets):
    errors = []

    def wrap(fn):
        def go():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported to the test below
                errors.append(e)
        return go

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_every_tensor_arrives_in_order_in_the_engines_dtype_at_each_receiver():
    gen = torch.Generator().manual_seed(0)
    params = [("model.embed_tokens.weight", torch.randn(7, 4, generator=gen)),
              ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 4, generator=gen)),
              ("model.norm.weight", torch.randn(4, generator=gen))]
    specs = [[n, list(t.shape)] for n, t in params]
    port, got, sent = _port(), {1: [], 2: []}, []

    def sender():
        group = open_channel("127.0.0.1", port, 0, 3, "gloo", 30)
        sent.append(send_parameters(group, iter(params), torch.bfloat16, torch.device("cpu")))

    def receiver(rank):
        def go():
            group = open_channel("127.0.0.1", port, rank, 3, "gloo", 30)
            got[rank].extend(receive_parameters(group, specs, torch.bfloat16, torch.device("cpu")))
        return go

    _run(sender, receiver(1), receiver(2))
    assert sent == [sum(t.numel() * 2 for _, t in params)]
    for rank in (1, 2):
        assert [n for n, _ in got[rank]] == [n for n, _ in params]
        for (_, want), (_, t) in zip(params, got[rank]):
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, want.to(torch.bfloat16))


def test_a_rank_without_the_channel_and_without_shards_sends_nothing():
    assert send_parameters(None, [("w", torch.ones(3))], torch.bfloat16, torch.device("cpu")) == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="backend"):
        open_channel("127.0.0.1", _port(), 0, 2, "mpi", 5)
    with pytest.raises(ValueError, match="outside"):
        open_channel("127.0.0.1", _port(), 2, 2, "gloo", 5)
