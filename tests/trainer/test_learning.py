"""The first steps of the ``cpu`` preset move the real actor the right way (docs/learning.md).

Slow (one real GRPO step of the default 135M actor on MiniHack Room-Random-5x5: several minutes on a
2-core CPU), run in CI.  It would fail on a sign error in the advantages or the loss, a zero learning
rate, an update that trains no sample, or an update that never reaches the sampling engine.
"""

import math

import pytest
import torch


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.xdist_group("learning-cpu-step")
def test_cpu_preset_step_favours_the_winning_actions():
    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.loop import Trainer
    from crl_bench.trainer.policy import build_batch, episode_samples, sequence_logprobs

    # the cpu preset as shipped, with fewer groups, and activations kept rather than recomputed in
    # backward (the preset recomputes them to bound memory: the same gradients, one forward more)
    cfg = build_config([preset_data("cpu"), {"train": {"groups_per_step": 3, "seed": 0},
                                             "model": {"gradient_checkpointing": False}}])
    assert cfg.rollout.env_kwargs["minihack-room"]["variant"] == "MiniHack-Room-Random-5x5-v0"
    tr = Trainer(cfg)
    try:
        before = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
        res = tr.train_step()
        m = res.metrics
        assert m["groups_with_signal"] >= 1, m          # the base actor succeeds sometimes (~14%)
        assert m["optimizer_steps"] == 1 and m["grad_norm"] > 0
        assert 0.0 < m["reply_entropy"] <= math.log(12) + 1e-6 and 0.0 < m["entropy"]   # see test_smoke_run
        advs = tr.advantages(res.trajectories)
        # the sequences the update trained (the preset's multiturn episodes: one per episode, its
        # replies masked in), so each log-prob below is a whole episode's replies
        samples = [s for s in episode_samples(res.trajectories, advs, layout=cfg.train.sequences)
                   if s.advantage != 0]
        adv = torch.tensor([s.advantage for s in samples])
        win = adv > 0
        assert win.any() and (~win).any()

        def action_logprobs() -> torch.Tensor:
            out = []
            with torch.no_grad():
                for i in range(0, len(samples), 16):
                    batch = build_batch(samples[i:i + 16], tr.tokenizer.pad_token_id)
                    out.append((sequence_logprobs(tr.model, batch) * batch["mask"]).sum(-1))
            return torch.cat(out)

        after = action_logprobs()
        trained = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
        tr.model.load_state_dict(before)
        start = action_logprobs()
        tr.model.load_state_dict(trained)
        delta = after - start                 # per sequence: log P(replies) after minus before the update
        # the step ascended the GRPO objective: the advantage-weighted change of the replies' log-probs
        # is positive, and the winning episodes' replies gained against the losing ones'. (The winners'
        # own mean may fall: a reply such as "north" that is in both, mostly in losing episodes, is
        # pushed down by both; measured on a 2-core Intel Xeon with AMX: winners -0.02, losers -0.31.)
        assert float((adv * delta).sum()) > 0.0, (adv, delta)
        assert float(delta[win].mean()) > float(delta[~win].mean()) + 0.05, delta
        # and the sampling engine acts with the updated weights (its copy in the compute dtype)
        name, p = next((n, p) for n, p in tr.model.named_parameters() if not torch.equal(p, before[n]))
        q = dict(tr.engine.generator.named_parameters())[name]
        assert torch.equal(q, p.detach().to(q.dtype))
    finally:
        tr.close()
