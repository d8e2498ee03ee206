"""The actor update on a tiny random model: masking, alignment and that it actually learns."""

import pytest
import torch

from crl_bench.trainer.policy import PolicyUpdater, TokenSample, build_batch, sequence_logprobs


def _samples(tokenizer, model, adv=(1.0, -1.0)):
    prompts = [tokenizer.encode("<|im_start|>user\nGo north.<|im_end|>\n<|im_start|>assistant\n<answer>"),
               tokenizer.encode("<|im_start|>user\nA longer prompt about the map.<|im_end|>\n<answer>")]
    responses = [tokenizer.encode("north</answer>"), tokenizer.encode("west</answer>")]
    out = []
    for p, r, a in zip(prompts, responses, adv):
        batch = build_batch([TokenSample(p, r, [0.0] * len(r), a)], tokenizer.pad_token_id)
        with torch.no_grad():
            lp = sequence_logprobs(model, batch)[0].tolist()
        out.append(TokenSample(p, r, lp, a))
    return out


def test_build_batch_alignment(tokenizer, tiny_model):
    s = _samples(tokenizer, tiny_model)
    b = build_batch(s, tokenizer.pad_token_id)
    rmax = max(len(x.response_ids) for x in s)
    assert b["targets"].shape == (2, rmax)
    for i, x in enumerate(s):
        r = len(x.response_ids)
        assert b["targets"][i, rmax - r:].tolist() == x.response_ids
        assert b["mask"][i].sum().item() == r
    # batched log-probs equal each sample's own (left padding + position ids are handled)
    with torch.no_grad():
        lp = sequence_logprobs(tiny_model, b)
    for i, x in enumerate(s):
        r = len(x.response_ids)
        assert lp[i, rmax - r:].tolist() == pytest.approx(x.old_logprobs, abs=1e-4)


def test_prompt_tokens_get_no_gradient(tokenizer, tiny_model):
    """Changing prompt-position logits cannot change the loss: the gradient on them is exactly 0."""
    s = _samples(tokenizer, tiny_model)
    b = build_batch(s, tokenizer.pad_token_id)
    out = tiny_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                     position_ids=b["position_ids"], use_cache=False)
    logits = out.logits
    logits.retain_grad()
    rmax = b["targets"].shape[1]
    from crl_bench.trainer.losses import ppo_clip_loss, token_logprobs

    lp = token_logprobs(logits[:, -rmax - 1:-1], b["targets"])
    loss, _ = ppo_clip_loss(lp, b["old_logprobs"], b["advantages"], b["mask"])
    loss.backward()
    g = logits.grad.abs().sum(-1)               # (B, L)
    L = logits.shape[1]
    for i, x in enumerate(s):
        r = len(x.response_ids)
        first_pred = L - r - 1                  # logit that predicts the first response token
        assert g[i, :first_pred].sum().item() == 0.0
        assert g[i, first_pred:L - 1].sum().item() > 0.0


def test_update_raises_logprob_of_positive_advantage(tokenizer, tiny_model):
    s = _samples(tokenizer, tiny_model, adv=(1.0, -1.0))
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    up = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id, micro_batch_size=1)
    before = [sum(x.old_logprobs) for x in s]
    for _ in range(3):
        stats = up.update(s)
    assert stats["optimizer_steps"] == 1.0 and stats["trained_samples"] == 2.0
    after = []
    for x in s:
        with torch.no_grad():
            after.append(sequence_logprobs(tiny_model, build_batch([x], tokenizer.pad_token_id))[0].sum().item())
    assert after[0] > before[0]
    assert after[1] < before[1]


def test_zero_advantage_makes_no_step(tokenizer, tiny_model):
    s = _samples(tokenizer, tiny_model, adv=(0.0, 0.0))
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    w = tiny_model.lm_head.weight.detach().clone()
    stats = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id).update(s)
    assert stats["optimizer_steps"] == 0.0
    assert torch.equal(w, tiny_model.lm_head.weight)


def test_micro_batching_equals_full_batch(tokenizer, tiny_model):
    """Gradient accumulation with token-level normalisation equals one big batch."""
    import copy

    s = _samples(tokenizer, tiny_model)
    grads = []
    for mbs in (1, 2):
        m = copy.deepcopy(tiny_model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        PolicyUpdater(m, opt, tokenizer.pad_token_id, micro_batch_size=mbs, max_grad_norm=0).update(s)
        grads.append(m.lm_head.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert grads[0].abs().max() > 1e-3


def test_build_batch_rejects_bad_samples():
    with pytest.raises(ValueError):
        build_batch([], 0)
    with pytest.raises(ValueError):
        build_batch([TokenSample([1], [], [], 1.0)], 0)
