"""Multi-turn episodes as training sequences: token-in, token-out prompts (the ids the actor sampled are
the ids it later sees and is trained on) and one sequence per episode whose loss and gradient equal
those of the per-turn samples."""

from __future__ import annotations

import pytest
import torch

from crl_bench.llm.base import Generation, SamplingParams
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner, Trajectory, Turn
from crl_bench.trainer.policy import (
    PolicyUpdater,
    TokenSample,
    append_only,
    episode_samples,
    episode_sequence,
    token_weights,
)


class SplitReplyEngine:
    """Replies ``up</answer>`` to every prompt, sampled one character per token (ids a tokenizer would
    never produce for that text: its own encoding merges characters), optionally ending with EOS."""

    def __init__(self, tokenizer, eos: bool = False):
        self.tokenizer = tokenizer
        self.eos = eos
        self.prompts: list[list[int]] = []

    def reply_ids(self) -> list[int]:
        ids = [self.tokenizer.convert_tokens_to_ids(c) for c in "up</answer>"]
        return ids + ([self.tokenizer.eos_token_id] if self.eos else [])

    def generate(self, prompts, params, allowed=None):
        self.prompts += [list(p) for p in prompts]
        ids = self.reply_ids()
        return [Generation(list(p), ids, [-0.5] * len(ids), "up</answer>", "eos" if self.eos else "stop")
                for p in prompts]

    def sync_weights(self, model):
        pass


def _rollout(engine, tokenizer, layout: str, steps: int = 3, n: int = 1) -> list[Trajectory]:
    runner = RolloutRunner(engine, PromptBuilder(tokenizer, layout=layout), EnvPool(max_steps=steps),
                           SamplingParams(temperature=1.0, max_new_tokens=8), constrained=False)
    return runner.collect([EpisodeSpec("sokoban", 5, group_id=0) for _ in range(n)])


@pytest.mark.parametrize("eos", [False, True])
def test_multiturn_prompts_carry_the_sampled_ids_unchanged(tokenizer, eos):
    engine = SplitReplyEngine(tokenizer, eos)
    sampled = engine.reply_ids()
    assert tokenizer.encode("up</answer>", add_special_tokens=False) != sampled[:11]   # a re-encode differs
    turns = _rollout(engine, tokenizer, "multiturn")[0].turns
    assert len(turns) == 3
    for prev, cur in zip(turns, turns[1:]):
        n = len(prev.prompt_ids)
        assert cur.prompt_ids[:n] == prev.prompt_ids
        assert cur.prompt_ids[n:n + len(sampled)] == sampled           # the sampled ids, not re-encoded
        after = cur.prompt_ids[n + len(sampled):]
        # the template's close of the reply follows; a sampled end-of-turn token is not repeated
        assert tokenizer.decode(after).startswith("\n<|im_start|>user\n" if eos else "<|im_end|>\n<|im_start|>user")
        assert tokenizer.decode(cur.prompt_ids).endswith("<|im_start|>assistant\n<answer>")
    assert append_only(turns)
    seq = episode_sequence(_rollout(SplitReplyEngine(tokenizer, eos), tokenizer, "multiturn")[0], 1.0)
    assert seq is not None
    trained = [t for t, m in zip(seq.response_ids, seq.loss_mask) if m]
    assert trained == sampled * 3                                      # the ids trained on are the sampled ones


def test_multiturn_prompt_matches_the_template_of_the_chat(tokenizer):
    """Where the actor's ids are the tokenizer's own encoding of its reply, the token-in, token-out
    prompt is exactly the chat template of the whole chat, encoded."""

    class Canonical(SplitReplyEngine):
        def reply_ids(self):
            return tokenizer.encode("up</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]

    pb = PromptBuilder(tokenizer, layout="multiturn")
    runner = RolloutRunner(Canonical(tokenizer), pb, EnvPool(max_steps=3),
                           SamplingParams(temperature=1.0, max_new_tokens=8), constrained=False)
    tr = runner.collect([EpisodeSpec("sokoban", 5)])[0]
    last = tr.turns[-1]
    text = tokenizer.decode(last.prompt_ids)
    assert text.count("<answer>up</answer><|im_end|>\n") == 2
    assert text.count("<|im_start|>user\n") == 3


def _turn(prompt, resp, lps):
    return Turn(list(prompt), list(resp), list(lps), "a", False, 0.0)


def test_episode_sequence_masks_the_environment_and_aligns_logprobs():
    t0 = _turn([1, 2, 3], [10, 11], [-0.1, -0.2])
    t1 = _turn([1, 2, 3, 10, 11, 4, 5], [12], [-0.3])
    t2 = _turn([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], [-0.4, -0.5])
    tr = Trajectory("sokoban", 0, 0, "free", turns=[t0, t1, t2])
    s = episode_sequence(tr, 2.0, sequence=7)
    assert s.prompt_ids == [1, 2, 3]
    assert s.response_ids == [10, 11, 4, 5, 12, 6, 13, 14]
    assert s.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert s.old_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert (s.advantage, s.sequence, s.trained_tokens) == (2.0, 7, 5)
    # one token of a later prompt differs from the earlier reply: not append-only, trained per turn
    bad = _turn([1, 2, 3, 10, 99, 4, 5], [12], [-0.3])
    tr_bad = Trajectory("sokoban", 0, 0, "free", turns=[t0, bad])
    assert not append_only(tr_bad.turns) and episode_sequence(tr_bad, 1.0) is None
    counts: dict[str, int] = {}
    samples = episode_samples([tr, tr_bad], [1.0, -1.0], counts=counts)
    assert [s.sequence for s in samples] == [0, 1, 1]
    assert counts == {"episode_sequences": 1, "turn_sample_episodes": 1}
    assert len(episode_samples([tr], [1.0], layout="turn")) == 3
    # seq-mean-token-mean weighs the whole-episode sample as its per-turn samples together
    w = token_weights(samples, "seq-mean-token-mean")
    assert w == [pytest.approx(1 / (2 * 5)), pytest.approx(1 / (2 * 3)), pytest.approx(1 / (2 * 3))]
    with pytest.raises(ValueError, match="layout"):
        episode_samples([tr], [1.0], layout="turns")


def test_window_prompts_are_trained_per_turn(tokenizer):
    trajs = _rollout(SplitReplyEngine(tokenizer), tokenizer, "window", n=2)
    counts: dict[str, int] = {}
    samples = episode_samples(trajs, [1.0, -1.0], counts=counts)
    assert counts == {"episode_sequences": 0, "turn_sample_episodes": 2}
    assert len(samples) == sum(len(t.turns) for t in trajs) == 6
    assert all(s.loss_mask is None for s in samples)


def _loss_and_grads(model, samples, pad_id, temperature):
    upd = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.0), pad_id, micro_batch_size=8,
                        loss_agg="seq-mean-token-mean", temperature=temperature, share_prefix=False)
    model.zero_grad(set_to_none=True)
    out = upd.micro_backward(samples, token_weights(samples, "seq-mean-token-mean"), 0, fold=False)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.slow
def test_whole_episode_loss_and_gradient_equal_the_per_turn_samples(default_model_dir, tokenizer):
    """The real default model (float32): two 3-turn Sokoban episodes sampled by it with the
    multi-turn prompt, advantages +1 and -0.5: one sequence per episode gives the per-turn samples' loss
    and gradient under ``seq-mean-token-mean``, putting far fewer tokens through the model.

    The advantages do not cancel: at ratio 1 the loss is then about -0.25, not a difference of two
    equal means whose float32 rounding (about 1e-6 here) would decide its sign."""
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(default_model_dir), "float32")
    torch.manual_seed(0)
    trajs = _rollout(HFEngine(model, tokenizer), tokenizer, "multiturn", steps=3, n=2)
    assert [len(t.turns) for t in trajs] == [3, 3]
    counts: dict[str, int] = {}
    whole = episode_samples(trajs, [1.0, -0.5], counts=counts)
    per_turn = episode_samples(trajs, [1.0, -0.5], layout="turn")
    assert counts["episode_sequences"] == 2 and len(whole) == 2 and len(per_turn) == 6
    out_w, g_w = _loss_and_grads(model, whole, tokenizer.pad_token_id, 1.0)
    out_t, g_t = _loss_and_grads(model, per_turn, tokenizer.pad_token_id, 1.0)
    assert out_w["tokens"] == out_t["tokens"] == sum(t.response_tokens for t in trajs)
    assert abs(out_t["loss"]) > 0.1
    assert out_w["loss"] == pytest.approx(out_t["loss"], rel=1e-4, abs=1e-6)
    assert out_w["stats"]["ratio_mean"] == pytest.approx(out_t["stats"]["ratio_mean"], rel=1e-4)
    assert set(g_w) == set(g_t)
    scale = max(float(g.abs().max()) for g in g_t.values())
    assert scale > 0
    for n in g_t:
        torch.testing.assert_close(g_w[n], g_t[n], rtol=1e-3, atol=1e-4 * scale, msg=lambda m, n=n: f"{n}: {m}")
    assert out_w["input_tokens"] < 0.6 * out_t["input_tokens"]


def test_whole_episode_batch_keeps_logits_only_where_the_actor_wrote(tokenizer, tiny_model):
    """The environment's tokens of a whole-episode row get no logits (a (B, R, vocab) tensor over a
    whole episode would dwarf the model); the kept log-probs are those of the full computation."""
    from crl_bench.trainer.policy import build_batch, response_logprobs, sequence_logprobs

    ep = TokenSample([5, 6, 7], [10, 11, 4, 5, 12, 6, 13, 14], [0.0] * 8, 1.0, loss_mask=[1, 1, 0, 0, 1, 0, 1, 1])
    turn = TokenSample([5, 6, 7, 8], [20, 21], [0.0, 0.0], -1.0)
    batch = build_batch([ep, turn], tokenizer.pad_token_id, weights=[0.1, 0.2])
    assert batch["targets"].shape == (2, 5) and batch["cols"].tolist() == [0, 1, 4, 6, 7]
    assert batch["mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    unmasked = TokenSample(ep.prompt_ids, ep.response_ids, ep.old_logprobs, 1.0)
    full = build_batch([unmasked, turn], tokenizer.pad_token_id)
    with torch.no_grad():
        kept, every = sequence_logprobs(tiny_model, batch), sequence_logprobs(tiny_model, full)
    assert kept.shape == (2, 5) and every.shape == (2, 8)
    torch.testing.assert_close(kept, every[:, [0, 1, 4, 6, 7]])
    torch.testing.assert_close(response_logprobs(kept, batch, 0, 8), every[0] * torch.tensor(ep.loss_mask))
    torch.testing.assert_close(response_logprobs(kept, batch, 1, 2), every[1, -2:])


def test_micro_chunks_bound_samples_and_padded_tokens():
    from crl_bench.trainer.policy import micro_chunks

    assert micro_chunks([5, 5, 5, 5, 5], 2) == [range(0, 2), range(2, 4), range(4, 5)]
    # 3 x 30 > 80: the third item opens a new micro-batch; an item over the bound stands alone
    assert micro_chunks([10, 30, 30, 100, 10, 10], 8, tokens=80) == [range(0, 2), range(2, 3), range(3, 4),
                                                                     range(4, 6)]
    assert micro_chunks([], 4, 10) == []


def test_token_bounded_micro_batches_give_the_same_update(tokenizer, tiny_model):
    """micro_batch_tokens only changes how the step's sequences are split into forwards: the same
    weights after the update (gradient accumulation), with more micro-batches."""
    import copy

    trajs = _rollout(SplitReplyEngine(tokenizer), tokenizer, "multiturn", steps=3, n=4)
    for k, tr in enumerate(trajs):                  # behaviour log-probs off the model's: ratios != 1
        for t in tr.turns:
            t.logprobs = [-0.5 - 0.1 * k] * len(t.logprobs)
    samples = episode_samples(trajs, [1.0, -1.0, 0.5, -0.5])
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    out, models = [], []
    for tokens in (0, longest):
        m = copy.deepcopy(tiny_model)
        upd = PolicyUpdater(m, torch.optim.SGD(m.parameters(), lr=0.5), tokenizer.pad_token_id, micro_batch_size=4,
                            micro_batch_tokens=tokens, loss_agg="seq-mean-token-mean", share_prefix=False)
        plan = upd.plan(samples)
        out.append((upd.update(samples), [len(micros) for micros in plan]))
        models.append(m)
    assert out[0][1] == [1] and out[1][1] == [4]
    assert out[1][0]["loss"] == pytest.approx(out[0][0]["loss"], rel=1e-5)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


class RewritingTemplate:
    """The real tokenizer, but its chat template renders an assistant message unlike the text the actor
    generated after the generation prompt (as templates that rewrite earlier replies do)."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def apply_chat_template(self, messages, **kw):
        shown = [dict(m, content=f"[{m['content']}]") if m["role"] == "assistant" else m for m in messages]
        return self.tok.apply_chat_template(shown, **kw)


def test_a_template_that_rewrites_replies_falls_back_to_per_turn_samples(tokenizer):
    tok = RewritingTemplate(tokenizer)
    pb = PromptBuilder(tok, layout="multiturn")
    assert pb.continuation([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                            {"role": "assistant", "content": "<answer>up</answer>"}], "next", [1, 2]) is None
    runner = RolloutRunner(SplitReplyEngine(tokenizer), pb, EnvPool(max_steps=3),
                           SamplingParams(temperature=1.0, max_new_tokens=8), constrained=False)
    trajs = runner.collect([EpisodeSpec("sokoban", 5)])
    assert "[<answer>up</answer>]" in tokenizer.decode(trajs[0].turns[-1].prompt_ids)   # the whole chat re-encoded
    counts: dict[str, int] = {}
    samples = episode_samples(trajs, [1.0], counts=counts)
    assert counts == {"episode_sequences": 0, "turn_sample_episodes": 1} and len(samples) == 3
