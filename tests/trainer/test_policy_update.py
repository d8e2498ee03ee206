"""The actor update on a tiny random model: masking, alignment and that it actually learns."""

import pytest
import torch

from crl_bench.trainer.policy import PolicyUpdater, TokenSample, build_batch, sequence_logprobs


class GradSGD(torch.optim.SGD):
    """SGD at learning rate 0 that keeps a copy of each parameter's gradient at its last step: the
    updater frees the gradients once the update is done, so the tests read them here."""

    def __init__(self, model):
        self.names = {p: n for n, p in model.named_parameters()}
        super().__init__(model.parameters(), lr=0.0)
        self.grads = {}

    def step(self, closure=None):
        self.grads = {self.names[p]: p.grad.clone() for g in self.param_groups for p in g["params"]
                      if p.grad is not None}
        return super().step(closure)

    def grad(self, param):
        """The recorded gradient of ``param`` (a tied weight under its first name)."""
        return self.grads[self.names[param]]


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
    # the gradients are freed after the update, not kept resident until the next one
    assert all(p.grad is None for p in tiny_model.parameters())


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
        opt = GradSGD(m)
        PolicyUpdater(m, opt, tokenizer.pad_token_id, micro_batch_size=mbs, max_grad_norm=0).update(s)
        grads.append(opt.grad(m.lm_head.weight))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert grads[0].abs().max() > 1e-3


def test_build_batch_rejects_bad_samples():
    with pytest.raises(ValueError):
        build_batch([], 0)
    with pytest.raises(ValueError):
        build_batch([TokenSample([1], [], [], 1.0)], 0)


def test_token_weights_modes():
    from crl_bench.trainer.policy import token_weights

    a = TokenSample([1], [5, 6], [0.0, 0.0], 1.0, sequence="ep0")
    b1 = TokenSample([1], [5, 6, 7], [0.0] * 3, -1.0, sequence="ep1")
    b2 = TokenSample([1, 2], [8], [0.0], -1.0, sequence="ep1")
    # seq-mean-token-mean: two sequences; ep0 has 2 tokens, ep1 has 4 (over two turns)
    assert token_weights([a, b1, b2], "seq-mean-token-mean") == pytest.approx([1 / 4, 1 / 8, 1 / 8])
    assert token_weights([a, b1, b2], "token-mean") == pytest.approx([1 / 6] * 3)
    with pytest.raises(ValueError):
        token_weights([a], "sum")


def test_seq_mean_token_mean_weighs_each_episode_once(tokenizer, tiny_model):
    """The gradient equals the hand-written mean over episodes of each episode's token mean, where one
    episode's two turns are two samples; token-mean gives a different gradient."""
    import copy

    from crl_bench.trainer.losses import ppo_clip_loss

    s = _samples(tokenizer, tiny_model, adv=(1.0, -1.0))
    short = TokenSample(s[0].prompt_ids, s[0].response_ids[:2], s[0].old_logprobs[:2], 1.0, sequence="a")
    turn1 = TokenSample(s[1].prompt_ids, s[1].response_ids, s[1].old_logprobs, -1.0, sequence="b")
    turn2 = TokenSample(s[0].prompt_ids, s[0].response_ids, s[0].old_logprobs, -1.0, sequence="b")
    samples = [short, turn1, turn2]

    def grad_of(agg):
        m = copy.deepcopy(tiny_model)
        opt = GradSGD(m)
        PolicyUpdater(m, opt, tokenizer.pad_token_id, micro_batch_size=2, max_grad_norm=0,
                      loss_agg=agg).update(samples)
        return opt.grad(m.lm_head.weight)

    m = copy.deepcopy(tiny_model)
    per_seq = {}
    for x in samples:
        b = build_batch([x], tokenizer.pad_token_id)
        lp = sequence_logprobs(m, b)
        loss_sum, _ = ppo_clip_loss(lp, b["old_logprobs"], b["advantages"], b["mask"], normalizer=1.0)
        total, n = per_seq.get(x.sequence, (0.0, 0))
        per_seq[x.sequence] = (total + loss_sum, n + len(x.response_ids))
    manual = sum(t / n for t, n in per_seq.values()) / len(per_seq)
    manual.backward()
    expected = m.lm_head.weight.grad
    got = grad_of("seq-mean-token-mean")
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(grad_of("token-mean"), expected, rtol=1e-3, atol=1e-6)


def test_mini_batches_keep_an_episode_together(tokenizer, tiny_model):
    s = _samples(tokenizer, tiny_model)
    turns = [TokenSample(x.prompt_ids, x.response_ids, x.old_logprobs, 1.0, sequence="ep") for x in s]
    other = TokenSample(s[0].prompt_ids, s[0].response_ids, s[0].old_logprobs, -1.0, sequence="other")
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    stats = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id, mini_batches=2,
                          loss_agg="seq-mean-token-mean").update(turns + [other])
    assert stats["optimizer_steps"] == 2.0                 # two sequences -> two mini-batches, not three


def test_recompute_old_logprobs(tokenizer, tiny_model):
    """With a sampler that differs from the trainer (here: behaviour log-probs off by 0.5), the update
    recomputes them: the first ratio is exactly 1 and the drift is reported."""
    s = _samples(tokenizer, tiny_model)
    skewed = [TokenSample(x.prompt_ids, x.response_ids, [lp - 0.5 for lp in x.old_logprobs], x.advantage)
              for x in s]
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    plain = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id).update(skewed)
    assert plain["ratio_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.5))), rel=1e-3)
    assert "behaviour_logprob_abs_diff" not in plain
    st = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id, recompute_old_logprobs=True).update(skewed)
    assert st["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert st["behaviour_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-3)
    assert st["behaviour_ratio_min"] == pytest.approx(st["behaviour_ratio_max"], rel=1e-3)
    assert st["behaviour_ratio_std"] == pytest.approx(0.0, abs=1e-3)


def _shared_samples(tokenizer, advs=(1.0, -0.5, 0.25)):
    head = ("<|im_start|>system\nYou play a small grid game. Reach the stairs; each turn pick one move "
            "from north, east, south, west.<|im_end|>\n<|im_start|>user\n")
    tails = ["You are at row 1.", "You are at row 2, column 3, next to a wall.", "Row 0."]
    replies = ["north</answer>", "east</answer>", "south west</answer>"]
    out = []
    for t, r, a in zip(tails, replies, advs):
        p = tokenizer.encode(head + t + "<|im_end|>\n<|im_start|>assistant\n<answer>")
        rid = tokenizer.encode(r)
        out.append(TokenSample(p, rid, [-1.0] * len(rid), a))
    return out


def test_shared_prefix_forward_equals_full_forward(tokenizer, tiny_model):
    """The shared-prefix forward (prefix once, broadcast as the cache) gives the same log-probs and the
    same gradient as the plain left-padded forward, prompts of different lengths included."""
    import copy

    from crl_bench.trainer.policy import common_prefix_length, shared_prefix_logprobs

    s = _shared_samples(tokenizer)
    shared = common_prefix_length(s)
    assert shared >= 20 and all(x.prompt_ids[:shared] == s[0].prompt_ids[:shared] for x in s)
    assert len({x.prompt_ids[shared] for x in s}) > 1
    lp_full = sequence_logprobs(tiny_model, build_batch(s, tokenizer.pad_token_id))
    lp_shared, batch = shared_prefix_logprobs(tiny_model, s, shared, tokenizer.pad_token_id)
    mask = batch["mask"].bool()
    assert torch.allclose(lp_full[mask], lp_shared[mask], atol=1e-5)

    grads, stats = [], []
    for share in (False, True):
        m = copy.deepcopy(tiny_model)
        opt = GradSGD(m)
        st = PolicyUpdater(m, opt, tokenizer.pad_token_id, micro_batch_size=3, max_grad_norm=0,
                           share_prefix=share, min_shared_prefix=8).update(s)
        stats.append(st)
        grads.append(opt.grads)
    assert stats[0]["shared_prefix_tokens"] == 0 and stats[1]["shared_prefix_tokens"] == 2 * shared
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-4)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert float((g - grads[1][name]).norm()) <= 1e-3 * float(g.norm()) + 1e-12, name
    # tokens only the shared prefix holds get their gradient through the broadcast cache
    only_prefix = set(s[0].prompt_ids[:shared]) - {t for x in s for t in x.prompt_ids[shared:] + x.response_ids}
    rows = torch.tensor(sorted(only_prefix))
    emb = [g["model.embed_tokens.weight"][rows] for g in grads]
    assert float(emb[1].norm()) > 0 and float((emb[0] - emb[1]).norm()) <= 1e-3 * float(emb[0].norm())


def test_shared_prefix_with_identical_prompts(tokenizer, tiny_model):
    """A group's first turns have identical prompts: all but the last prompt token are shared, and the
    gradient still equals the plain forward's."""
    import copy

    base = _shared_samples(tokenizer)[0]
    s = [TokenSample(base.prompt_ids, r, [-1.0] * len(r), a)
         for r, a in ((tokenizer.encode("north</answer>"), 1.0), (tokenizer.encode("west</answer>"), -1.0))]
    grads, stats = [], []
    for share in (False, True):
        m = copy.deepcopy(tiny_model)
        opt = GradSGD(m)
        stats.append(PolicyUpdater(m, opt, tokenizer.pad_token_id, max_grad_norm=0, share_prefix=share,
                                   min_shared_prefix=8).update(s))
        grads.append(opt.grad(m.lm_head.weight))
    assert stats[1]["shared_prefix_tokens"] == len(base.prompt_ids) - 1
    assert float((grads[0] - grads[1]).norm()) <= 1e-3 * float(grads[0].norm())


def test_shared_prefix_is_off_with_gradient_checkpointing(tokenizer, tiny_model):
    import copy

    m = copy.deepcopy(tiny_model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    st = PolicyUpdater(m, opt, tokenizer.pad_token_id, micro_batch_size=3, min_shared_prefix=8).update(
        _shared_samples(tokenizer))
    assert st["shared_prefix_tokens"] == 0 and st["optimizer_steps"] == 1


def test_folded_recompute_matches_a_separate_pass(tokenizer, tiny_model):
    """With one optimiser step the recomputed old log-probs come from the training forward itself:
    the same drift statistics as the separate no-gradient pass, ratio exactly 1."""
    s = [TokenSample(x.prompt_ids, x.response_ids, [lp - 0.3 for lp in x.old_logprobs], x.advantage)
         for x in _samples(tokenizer, tiny_model)]
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    up = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id, recompute_old_logprobs=True)
    _, separate = up._recompute(s)
    folded = up.update(s)
    assert folded["ratio_mean"] == 1.0 and folded["clip_frac"] == 0.0
    for k, v in separate.items():
        assert folded[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_linear_warmup_scales_the_first_steps(tokenizer, tiny_model):
    from crl_bench.trainer.policy import linear_warmup

    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    up = PolicyUpdater(tiny_model, opt, tokenizer.pad_token_id, scheduler=linear_warmup(opt, 4))
    s = _samples(tokenizer, tiny_model)
    lrs = [up.update(s)["lr"] for _ in range(6)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="warm-up"):
        linear_warmup(opt, 0)
