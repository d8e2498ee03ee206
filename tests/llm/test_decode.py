"""The engine's own decode loop (crl_bench/llm/decode.py) against transformers' ``model.generate``
(``HFEngine(decode_loop=False)``): same token ids, log-probs and entropies at temperature 0."""

import pytest
import torch

from crl_bench.llm.base import SamplingParams
from crl_bench.llm.gate import ComputeGate
from crl_bench.llm.hf_engine import HFEngine
from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, stop=())


def _prompts(tokenizer, n=5):
    from crl_bench.env_api import make_env

    pb = PromptBuilder(tokenizer)
    prompts, allowed = [], []
    for t in range(n):
        env = make_env("sokoban")
        obs, _ = env.reset(options={"task": t})
        prompts.append(pb.build(env.system_prompt, pb.user_text(env.task_prompt(), [], obs)))
        # replies of different lengths, so rows finish (EOS) at different steps
        allowed.append([a + "</answer>" for a in env.admissible_actions()] + ["wait a moment</answer>"])
    return prompts, allowed


def _same(a, b):
    assert a.response_ids == b.response_ids
    assert a.finish_reason == b.finish_reason and a.text == b.text
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert a.extra["entropy"] == pytest.approx(b.extra["entropy"], abs=1e-4)
    assert a.extra["sampling_entropy"] == pytest.approx(b.extra["sampling_entropy"], abs=1e-4)


def _both(tokenizer, model, calls, drop=True, **kw):
    """``calls(engine)`` on a generate engine and a decode-loop engine of the same settings."""
    old = calls(HFEngine(model, tokenizer, decode_loop=False, **kw))
    new = calls(HFEngine(model, tokenizer, decode_loop=True, drop_finished=drop, **kw))
    assert len(old) == len(new)
    for a, b in zip(old, new):
        _same(a, b)
    return old, new


@pytest.mark.parametrize("drop", [True, False])
def test_plain_and_constrained_equal_generate(tokenizer, tiny_model, drop):
    """Free and constrained rows in one batch, then the same prompts again (their heads now cached):
    the loop's replies are generate's, and constrained rows end with EOS at different steps."""
    prompts, allowed = _prompts(tokenizer)
    mixed = [a if i % 2 else None for i, a in enumerate(allowed)]
    forced = [["up" + " and up" * i + "</answer>"] for i in range(len(prompts))]    # one reply, i + 1 words

    def calls(eng):
        return (eng.generate(prompts, GREEDY) + eng.generate(prompts, GREEDY, mixed)
                + eng.generate(prompts, GREEDY, forced))

    old, _ = _both(tokenizer, tiny_model, calls, drop=drop, batch_size=8, min_prefix=8)
    lengths = {len(g.response_ids) for g in old[-5:]}
    assert len(lengths) > 1 and all(g.finish_reason == "eos" for g in old[-5:])


def test_stop_strings_equal_generate(tokenizer, tiny_model):
    """A stop string the model does produce (the text of one row's second token) ends that row early."""
    prompts, _ = _prompts(tokenizer, 4)
    free = HFEngine(tiny_model, tokenizer, decode_loop=False).generate(prompts, GREEDY)
    stop = tokenizer.decode(free[1].response_ids[1:2])
    params = SamplingParams(temperature=0, max_new_tokens=6, stop=(stop,))
    old, _ = _both(tokenizer, tiny_model, lambda e: e.generate(prompts, params), prefix_cache=False)
    assert old[1].finish_reason == "stop" and len(old[1].response_ids) <= 2


def test_multiturn_keep_sequences_equal_generate(tokenizer, tiny_model):
    """Multi-turn episodes (each turn's prompt extends the previous prompt and reply, stored with
    ``keep_sequences``): same turns as generate's, and the store serves most prompt tokens."""
    specs = [EpisodeSpec("sokoban", t, group_id=t) for t in (0, 1) for _ in range(2)]
    trajs, engines = [], []
    for loop in (False, True):
        eng = HFEngine(tiny_model, tokenizer, batch_size=8, keep_sequences=True, decode_loop=loop)
        runner = RolloutRunner(eng, PromptBuilder(tokenizer, layout="multiturn"), EnvPool(max_steps=3),
                               SamplingParams(temperature=0, max_new_tokens=8), constrained=True)
        trajs.append(runner.collect(specs))
        engines.append(eng)
    turns = 0
    for a, b in zip(*trajs):
        assert len(a.turns) == len(b.turns)
        for ta, tb in zip(a.turns, b.turns):
            assert ta.prompt_ids == tb.prompt_ids and ta.response_ids == tb.response_ids
            assert ta.logprobs == pytest.approx(tb.logprobs, abs=1e-4)
            turns += 1
    assert turns > len(specs)
    new = engines[1].counters
    assert new["cached_tokens"] > 0.6 * new["prompt_tokens"]


def _fresh_prompt(tokenizer):
    """A prompt of ~100 tokens that shares only the chat template with those of :func:`_prompts`."""
    return PromptBuilder(tokenizer).build("You are a careful agent.", " ".join(f"note{i}" for i in range(60)))


def _uneven_calls(tokenizer):
    """Two calls of a ``keep_sequences`` engine: six prompts, then five of them extended by their reply
    and a few tokens (served from the store but those few) beside one new prompt of ~100 tokens that
    shares only the chat template with them, so the second call's uncached parts are 2-5 vs ~100
    tokens."""
    prompts, allowed = _prompts(tokenizer, 6)
    fresh = _fresh_prompt(tokenizer)

    def calls(eng):
        first = eng.generate(prompts, GREEDY, allowed)
        second = [p + g.response_ids + tokenizer.encode(" ok", add_special_tokens=False)[:1] * (1 + i % 4)
                  for i, (p, g) in enumerate(zip(prompts[:5], first))] + [fresh]
        return first + eng.generate(second, GREEDY, allowed[:5] + [None])

    return calls


def test_grouped_prefill_equals_one_padded_forward_and_computes_fewer_positions(tokenizer, tiny_model):
    """Rows whose uncached prompt parts differ in length are prefilled in groups (``group_prefill``):
    the same replies, log-probs and entropies as one padded prefill and as generate, at fewer computed
    positions (one padded forward computes every row at the longest new part)."""
    calls = _uneven_calls(tokenizer)
    kw = dict(batch_size=8, keep_sequences=True)
    padded = HFEngine(tiny_model, tokenizer, group_prefill=False, **kw)
    grouped = HFEngine(tiny_model, tokenizer, group_prefill=True, **kw)
    a, b = calls(padded), calls(grouped)
    for x, y in zip(a, b):
        _same(x, y)
    _both(tokenizer, tiny_model, calls, **kw)
    assert grouped.counters["prefill_tokens"] == padded.counters["prefill_tokens"]
    assert grouped.counters["prefill_positions"] < 0.5 * padded.counters["prefill_positions"]


def test_grouped_prefill_keeps_the_seeded_samples(tokenizer, tiny_model):
    """Sampling after a grouped prefill draws what generate draws from the same seed: the groups change
    only how the prompt is computed, not the shape of any sampling draw."""
    prompts, allowed = _prompts(tokenizer, 6)
    fresh = _fresh_prompt(tokenizer)
    params = SamplingParams(temperature=1.5, max_new_tokens=6, stop=())
    outs, positions = [], []
    for loop in (False, True):
        torch.manual_seed(7)
        eng = HFEngine(tiny_model, tokenizer, decode_loop=loop, keep_sequences=True)
        first = eng.generate(prompts, params, allowed)
        second = [p + g.response_ids for p, g in zip(prompts[:5], first)] + [fresh]
        before = eng.counters["prefill_positions"]
        outs.append(first + eng.generate(second, params, allowed[:5] + [None]))
        positions.append(eng.counters["prefill_positions"] - before)
    for a, b in zip(*outs):
        _same(a, b)
    assert positions[1] < 0.5 * positions[0]            # the second call's prefill was grouped


def test_prefill_groups_are_the_cheapest_split():
    """The dynamic programme's split costs no more than any split of the sorted rows into runs (brute
    force over every cut set), covers each row once, and puts a few long rows apart from many short."""
    import itertools
    import random

    from crl_bench.llm.decode import prefill_groups

    def cost(groups, lengths, overhead):
        return sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([1, 2, 3, 5, 40, 121]) for _ in range(rng.randint(1, 8))]
        overhead = rng.choice([0, 8, 64])
        groups = prefill_groups(lengths, overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        srt = sorted(lengths)
        best = min(sum(len(srt[a:b]) * srt[b - 1] + overhead for a, b in zip((0,) + cuts, cuts + (len(srt),)))
                   for r in range(len(srt)) for cuts in itertools.combinations(range(1, len(srt)), r))
        assert cost(groups, lengths, overhead) == best
    lengths = [2] * 63 + [121]
    groups = prefill_groups(lengths)
    assert groups == [[63], list(range(63))]
    assert prefill_groups([7] * 5) == [list(range(5))]


def test_background_engine_with_gate_equals_generate_and_yields(tokenizer, tiny_model):
    """A background engine (chunked prefill, a yield point per token) gives generate's replies, and the
    loop yields to foreground work that waits."""
    prompts, _ = _prompts(tokenizer, 3)
    calls = []

    class Gate(ComputeGate):
        def yield_point(self):
            calls.append(1)
            super().yield_point()

    _both(tokenizer, tiny_model, lambda e: e.generate(prompts, GREEDY), gate=Gate(), background=True,
          prefill_chunk=64, min_prefix=8)
    assert len(calls) >= 2 * GREEDY.max_new_tokens


def test_top_k_one_is_greedy_and_sampling_entropy_is_the_masked_distribution(tokenizer, tiny_model):
    """Sampling with top-k 1 gives the greedy reply; at T = 1 without top-k/top-p the first token's
    sampling entropy is the entropy of the model's distribution restricted to the allowed first tokens."""
    prompts, allowed = _prompts(tokenizer, 3)
    eng = HFEngine(tiny_model, tokenizer, prefix_cache=False)
    greedy = eng.generate(prompts, GREEDY, allowed)
    torch.manual_seed(0)
    top1 = eng.generate(prompts, SamplingParams(temperature=0.7, top_k=1, max_new_tokens=6, stop=()), allowed)
    assert [g.response_ids for g in top1] == [g.response_ids for g in greedy]
    torch.manual_seed(0)
    sampled = eng.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=6, stop=()), allowed[:1])[0]
    firsts = sorted({tokenizer.encode(r, add_special_tokens=False)[0] for r in allowed[0]})
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompts[0]])).logits[0, -1].float()
    p = torch.softmax(logits[firsts], -1)
    assert sampled.extra["sampling_entropy"][0] == pytest.approx(float(-(p * p.log()).sum()), abs=1e-4)
    assert sampled.response_ids[0] in firsts


def test_samples_equal_generate_with_the_same_seed(tokenizer, tiny_model):
    """Sampling (temperature, top-k, top-p) draws the same tokens as generate from the same torch seed
    while no row has left the batch (free rows, no stop string)."""
    prompts, _ = _prompts(tokenizer, 3)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=6, stop=())
    outs = []
    for loop in (False, True):
        torch.manual_seed(3)
        outs.append(HFEngine(tiny_model, tokenizer, decode_loop=loop).generate(prompts, params))
    for a, b in zip(*outs):
        _same(a, b)


def test_samples_equal_generate_after_rows_leave_the_batch(tokenizer, tiny_model):
    """Constrained rows whose sampled replies differ in length leave the batch at different steps
    (``drop_finished``): every later draw, and the next call's, is still generate's from the same seed,
    because each step draws for the whole batch.  A draw over the live rows only would give other
    tokens from the first finished row on."""
    prompts, _ = _prompts(tokenizer, 6)
    allowed = [["up" + " and up" * k + "</answer>" for k in range(4)]] * len(prompts)   # 1 to 4 words
    params = SamplingParams(temperature=1.5, max_new_tokens=6, stop=())
    outs = []
    for loop in (False, True):
        torch.manual_seed(5)
        eng = HFEngine(tiny_model, tokenizer, decode_loop=loop, drop_finished=True)
        outs.append(eng.generate(prompts, params, allowed) + eng.generate(prompts, params, allowed))
    assert len({len(g.response_ids) for g in outs[0]}) > 1          # rows did finish at different steps
    for a, b in zip(*outs):
        _same(a, b)


@pytest.mark.slow
def test_real_model_greedy_equals_generate(default_model_dir):
    """The default model, constrained replies at T = 0 on 3 prompts: in float32 the decode loop's replies,
    log-probs and entropies are generate's; in bf16 (the generation copy where the CPU has bf16 units)
    the replies are the same and the log-probs within bf16's rounding: the two paths' attention kernels
    round bf16 activations differently, and each is ~0.04 nats (mean; max 0.13-0.16) from float32 on
    these prompts, measured 0.09 apart at most."""
    from crl_bench.llm.hf_engine import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(default_model_dir))
    chats = [[{"role": "user", "content": f"Room {i}: the key is {w}. Where do you go?"}]
             for i, w in enumerate(("north", "south", "west"))]
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for c in chats]
    allowed = [["go north</answer>", "go south</answer>", "wait</answer>", "go west then north</answer>"]] * 3
    params = SamplingParams(temperature=0, max_new_tokens=4)
    for dtype in (None, torch.bfloat16):
        eng = HFEngine(model, tok, prefix_cache=False, compute_dtype=dtype, decode_loop=False)
        old = eng.generate(prompts, params, allowed)
        eng.decode_loop = True
        new = eng.generate(prompts, params, allowed)
        for a, b in zip(old, new):
            if dtype is None:
                _same(a, b)
            else:
                assert a.response_ids == b.response_ids
                assert a.logprobs == pytest.approx(b.logprobs, abs=0.2)


def test_short_query_attention_equals_sdpa_and_padding_rows_stay_finite():
    """The grouped products give transformers' sdpa attention (float32, GQA, 1 and 4 new tokens, a
    padding mask); a query whose keys are all masked (a left-padding position) gets zeros, not NaN."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from crl_bench.llm.decode import short_query_attention

    class Attn:
        num_key_value_groups = 3
        is_causal = True

    gen = torch.Generator().manual_seed(0)
    for q in (1, 4):
        query = torch.randn(2, 6, q, 8, generator=gen)
        key, value = torch.randn(2, 2, 10, 8, generator=gen), torch.randn(2, 2, 10, 8, generator=gen)
        mask = torch.ones(2, 1, q, 10, dtype=torch.bool)
        mask[:, :, :, -q:] = torch.tril(torch.ones(q, q, dtype=torch.bool))
        mask[1, :, :, :3] = False                                  # row 1: 3 padding keys
        ref, _ = sdpa_attention_forward(Attn(), query, key, value, mask, scaling=0.3)
        out, _ = short_query_attention(Attn(), query, key, value, mask, scaling=0.3)
        assert out.shape == ref.shape == (2, q, 6, 8)
        assert torch.allclose(out, ref, atol=1e-5)
    mask[0, :, 0, :] = False                                       # a query that sees no key
    out, _ = short_query_attention(Attn(), query, key, value, mask, scaling=0.3)
    assert torch.isfinite(out).all() and not out[0, 0].any()
