"""Packed micro-batches (trainer/packing.py, ``train.packing``): the same log-probs, loss and gradient as
the left-padded rows, on fewer forward tokens; the token bound counts the packed rows' positions."""

import copy

import pytest
import torch

from crl_bench.trainer.packing import pack_batch, pack_rows, packed_chunks, packed_logprobs, packed_tokens
from crl_bench.trainer.policy import PolicyUpdater, TokenSample, build_batch, sequence_logprobs, token_weights


def _samples() -> list[TokenSample]:
    """Samples of very different lengths (so that packing saves rows), one of them a whole episode whose
    environment tokens are masked, with behaviour log-probs off the model's (ratios != 1)."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 4000, (n,), generator=g).tolist()

    out = []
    for k, (p, r, adv) in enumerate([(40, 6, 1.0), (9, 3, -1.0), (14, 5, 0.5), (25, 2, -0.5), (7, 4, 1.5)]):
        out.append(TokenSample(ids(p), ids(r), [-0.3 - 0.1 * k] * r, adv, sequence=k))
    mask = [1, 1, 0, 0, 0, 1, 1, 0, 1]
    out.append(TokenSample(ids(6), ids(9), [-0.7] * 9, -1.0, sequence=9, loss_mask=mask))
    return out


def test_pack_rows_first_fit_decreasing_within_the_longest():
    assert pack_rows([10, 4, 6, 3, 7], 10) == [[0], [4, 3], [2, 1]]
    assert pack_rows([], 5) == []
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([6], 5)


def test_packed_chunks_bound_the_packed_rows_not_items_times_longest():
    from crl_bench.trainer.policy import micro_chunks

    lengths = [100, 30, 30, 30, 100, 10]
    # padded: 2 x 100 fits 200, a third item makes 3 x 100; packed: 100 + 30 + 30 + 30 = 190 fits
    assert micro_chunks(lengths, 8, tokens=200) == [range(0, 2), range(2, 4), range(4, 6)]
    assert packed_chunks(lengths, 8, tokens=200) == [range(0, 4), range(4, 6)]
    assert packed_chunks(lengths, 2) == [range(0, 2), range(2, 4), range(4, 6)]
    assert packed_chunks([300, 10], 8, tokens=200) == [range(0, 1), range(1, 2)]
    # 220 real tokens, but 60 + 60 does not fit a 100-wide row: 3 rows x 100 > 250
    assert packed_tokens([100, 60, 60]) == 300 and packed_tokens([100, 60, 40]) == 200
    assert packed_chunks([100, 60, 60], 8, tokens=250) == [range(0, 2), range(2, 3)]
    assert packed_chunks([], 4, 10) == []


def test_packed_logprobs_equal_the_padded_forward(tokenizer, tiny_model):
    """float32: every trained token's log-prob of the packed rows equals the left-padded forward's; the
    rows hold all samples in fewer positions than the padded (B, longest) tensor."""
    samples = _samples()
    padded = build_batch(samples, tokenizer.pad_token_id)
    packed = pack_batch(samples, tokenizer.pad_token_id)
    assert packed["input_ids"].shape[1] == max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert packed["real_tokens"] == padded["real_tokens"] == sum(len(s.prompt_ids) + len(s.response_ids)
                                                                 for s in samples)
    assert packed["forward_tokens"] < 0.6 * padded["forward_tokens"]
    with torch.no_grad():
        a = sequence_logprobs(tiny_model, padded, temperature=1.5)
        b = packed_logprobs(tiny_model, packed, temperature=1.5)
    assert b.shape == packed["mask"].shape == (len(samples), 9)
    full = torch.zeros_like(b)                  # the padded batch keeps only the trained columns
    full[:, padded["cols"]] = a
    m = packed["mask"].bool()
    assert int(m.sum()) == sum(s.trained_tokens for s in samples)
    torch.testing.assert_close(b[m], full[m], rtol=1e-5, atol=1e-5)
    assert (b[~m] == 0).all()


def _one_update(model, samples, pad_id, packing, tokens=0, checkpointing=False, dtype=None):
    m = copy.deepcopy(model)
    if checkpointing:
        m.gradient_checkpointing_enable()
    upd = PolicyUpdater(m, torch.optim.SGD(m.parameters(), lr=0.0), pad_id, micro_batch_size=8,
                        micro_batch_tokens=tokens, loss_agg="seq-mean-token-mean", temperature=1.5,
                        share_prefix=False, packing=packing, compute_dtype=dtype, max_grad_norm=0)
    m.train()
    m.zero_grad(set_to_none=True)
    out = upd.micro_backward(samples, token_weights(samples, "seq-mean-token-mean"), 0, fold=False)
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    return out, grads, upd


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_loss_and_gradients_equal_the_padded_update(tokenizer, tiny_model, checkpointing):
    samples = _samples()
    pad = tokenizer.pad_token_id
    out_p, g_p, _ = _one_update(tiny_model, samples, pad, False, checkpointing=checkpointing)
    out_k, g_k, _ = _one_update(tiny_model, samples, pad, True, checkpointing=checkpointing)
    assert abs(out_p["loss"]) > 1e-3
    assert out_k["loss"] == pytest.approx(out_p["loss"], rel=1e-5, abs=1e-7)
    assert out_k["tokens"] == out_p["tokens"] and out_k["input_tokens"] == out_p["input_tokens"]
    assert out_k["forward_tokens"] < 0.6 * out_p["forward_tokens"]
    assert set(g_k) == set(g_p)
    scale = max(float(g.abs().max()) for g in g_p.values())
    for n in g_p:
        torch.testing.assert_close(g_k[n], g_p[n], rtol=1e-4, atol=1e-5 * scale, msg=lambda s, n=n: f"{n}: {s}")


def test_packed_update_under_bf16_autocast_tracks_the_padded_one(tokenizer, tiny_model):
    """bf16 compute over float32 weights: the packed and padded losses agree to bf16 rounding."""
    samples = _samples()
    pad = tokenizer.pad_token_id
    out_p, _, _ = _one_update(tiny_model, samples, pad, False, dtype=torch.bfloat16)
    out_k, g_k, _ = _one_update(tiny_model, samples, pad, True, dtype=torch.bfloat16)
    assert out_k["loss"] == pytest.approx(out_p["loss"], rel=0.05, abs=1e-3)
    assert all(g.dtype == torch.float32 for g in g_k.values())


def test_packed_update_puts_fewer_tokens_through_fewer_forwards(tokenizer, tiny_model):
    """A whole update with ``packing``: the same weights after one optimiser step as the padded update,
    fewer micro-batches under the same token bound, and ``update_forward_tokens`` (padding included)
    far below the padded update's while ``update_input_tokens`` (real tokens) is the same."""
    samples = _samples()
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    stats, plans, models = {}, {}, {}
    for packing in (False, True):
        m = copy.deepcopy(tiny_model)
        upd = PolicyUpdater(m, torch.optim.SGD(m.parameters(), lr=0.5), tokenizer.pad_token_id,
                            micro_batch_size=8, micro_batch_tokens=3 * longest, loss_agg="seq-mean-token-mean",
                            share_prefix=False, packing=packing, seed=3)
        plans[packing] = [len(micros) for micros in upd.plan(samples)]
        upd.rng.seed(3)
        stats[packing] = upd.update(samples)
        models[packing] = m
    assert plans[True] == [1] and plans[False] == [2]
    assert stats[True]["update_input_tokens"] == stats[False]["update_input_tokens"]
    assert stats[True]["update_forward_tokens"] < 0.8 * stats[False]["update_forward_tokens"]
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], rel=1e-5)
    for a, b in zip(models[False].parameters(), models[True].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_packing_needs_a_prompt_token(tokenizer):
    with pytest.raises(ValueError, match="non-empty prompt"):
        pack_batch([TokenSample([], [5, 6], [0.0, 0.0], 1.0)], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="empty batch"):
        pack_batch([], tokenizer.pad_token_id)


def test_train_packing_is_a_config_key():
    from crl_bench.config import build_config

    assert build_config([{"train": {"packing": True}}]).train.packing is True
    with pytest.raises(Exception, match="packing"):
        build_config([{"train": {"packing": "often"}}])


def test_shared_prefix_micro_batches_still_share_with_packing(tokenizer, tiny_model):
    """Without checkpointing, a micro-batch whose prompts share a prefix computes it once (its padded
    shared-prefix forward) whether ``packing`` is on or off: the same update either way."""
    g = torch.Generator().manual_seed(2)
    head = torch.randint(100, 4000, (40,), generator=g).tolist()
    samples = [TokenSample(head + torch.randint(100, 4000, (3 + k,), generator=g).tolist(),
                           torch.randint(100, 4000, (2 + k % 3,), generator=g).tolist(), [-0.4] * (2 + k % 3),
                           1.0 if k % 2 else -1.0, sequence=k) for k in range(4)]
    stats, models = {}, {}
    for packing in (False, True):
        m = copy.deepcopy(tiny_model)
        upd = PolicyUpdater(m, torch.optim.SGD(m.parameters(), lr=0.5), tokenizer.pad_token_id, micro_batch_size=4,
                            min_shared_prefix=8, packing=packing, seed=1)
        stats[packing], models[packing] = upd.update(samples), m
    assert stats[True]["shared_prefix_tokens"] == stats[False]["shared_prefix_tokens"] == 3 * 40
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], rel=1e-6)
    for a, b in zip(models[False].parameters(), models[True].parameters()):
        torch.testing.assert_close(b, a)
