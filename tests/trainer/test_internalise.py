"""Internalisation (the released MemoryActorPipeline's SFT): which guided episodes are kept, the prompts
they are stripped to, and the fine-tuning that raises their replies' log-probs under those prompts."""

from __future__ import annotations

import copy

import pytest
import torch
from test_episode_sequences import SplitReplyEngine

from crl_bench.llm.base import SamplingParams
from crl_bench.rollout import EnvPool, EpisodeSpec, Guidance, PromptBuilder, RolloutRunner, Trajectory, Turn
from crl_bench.trainer.internalise import Internaliser, select_episodes, sft_loss, stripped

LESSON = "Knowledge from earlier episodes:\n1. Push the box left first."


def _traj(group: int, subgroup: str, reward: float) -> Trajectory:
    return Trajectory("e", 0, group, subgroup, reward=reward)


def test_guided_episodes_strictly_above_their_groups_free_mean_are_kept():
    trajs = [_traj(0, "free", 0.0), _traj(0, "free", 1.0),                       # free mean 0.5
             _traj(0, "guided", 1.0), _traj(0, "guided", 0.5), _traj(0, "guided", 0.0),
             _traj(1, "guided", 0.5), _traj(1, "guided", 0.0),                     # no free episode: mean 0
             _traj(2, "free", 1.0), _traj(2, "guided", 1.0)]                       # equal is not above
    kept = select_episodes(trajs)
    assert [(t.group_id, t.reward) for t in kept] == [(0, 1.0), (1, 0.5)]
    assert all(t.subgroup == "guided" for t in kept)


def _rollout(tokenizer, layout: str, guidance: str = "", free_prompts: bool = False, turn_text: str = ""):
    runner = RolloutRunner(SplitReplyEngine(tokenizer), PromptBuilder(tokenizer, layout=layout),
                           EnvPool(max_steps=3), SamplingParams(temperature=1.0, max_new_tokens=16), constrained=False)
    runner.free_prompts = free_prompts
    hooks = {}
    if turn_text:
        hooks["turn_guide"] = lambda requests: [Guidance(turn_text, [7]) for _ in requests]
    spec = EpisodeSpec("sokoban", 5, group_id=0, subgroup="guided" if guidance or turn_text else "free",
                       guidance=guidance, turn_retrieve=bool(turn_text))
    return runner.collect([spec], **hooks)[0]


@pytest.mark.parametrize("layout", ["window", "multiturn"])
def test_the_free_prompts_are_the_prompts_of_the_same_episode_without_experience(tokenizer, layout):
    free = _rollout(tokenizer, layout)
    guided = _rollout(tokenizer, layout, guidance=LESSON, free_prompts=True)
    assert len(free.turns) == len(guided.turns) == 3
    for f, g in zip(free.turns, guided.turns):
        assert "Push the box left" in tokenizer.decode(g.prompt_ids)
        assert g.free_prompt_ids == f.prompt_ids and g.response_ids == f.response_ids
    assert all(t.free_prompt_ids is None for t in free.turns)
    # not recorded unless asked
    assert all(t.free_prompt_ids is None for t in _rollout(tokenizer, layout, guidance=LESSON).turns)


@pytest.mark.parametrize("layout", ["window", "multiturn"])
def test_turn_level_experience_is_stripped_too(tokenizer, layout):
    free = _rollout(tokenizer, layout)
    guided = _rollout(tokenizer, layout, free_prompts=True, turn_text="Earlier: up worked here.")
    assert all("up worked here" in tokenizer.decode(g.prompt_ids) for g in guided.turns)
    assert [g.free_prompt_ids for g in guided.turns] == [f.prompt_ids for f in free.turns]


def test_stripped_copies_use_the_free_prompts_and_refuse_what_cannot_be_stripped(tokenizer):
    guided = _rollout(tokenizer, "window", guidance=LESSON, free_prompts=True)
    copy_ = stripped(guided)
    assert copy_ is not None and copy_.guidance == ""
    assert [t.prompt_ids for t in copy_.turns] == [t.free_prompt_ids for t in guided.turns]
    assert [t.response_ids for t in copy_.turns] == [t.response_ids for t in guided.turns]
    assert guided.turns[0].prompt_ids != copy_.turns[0].prompt_ids             # the original is untouched
    unrecorded = _rollout(tokenizer, "window", guidance=LESSON)
    assert stripped(unrecorded) is None
    shown_nothing = _rollout(tokenizer, "window")
    assert [t.prompt_ids for t in stripped(shown_nothing).turns] == [t.prompt_ids for t in shown_nothing.turns]


def test_sft_loss_is_the_mean_negative_log_prob_of_the_masked_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, stats = sft_loss(lp, lp.detach(), torch.zeros(2), mask)
    assert float(loss.detach()) == pytest.approx((2.0 + 3.0 + 0.5) / 3) and stats["nll"] == pytest.approx(5.5 / 3)
    loss.backward()
    assert torch.allclose(lp.grad, -mask / 3)


def _seq_logprob(model, prompt: list[int], response: list[int]) -> float:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).sum())


def test_the_fine_tuning_raises_the_kept_replies_under_their_stripped_prompts(tokenizer, tiny_model):
    from crl_bench.config import build_config, preset_data
    from crl_bench.trainer.policy import PolicyUpdater

    model = copy.deepcopy(tiny_model)
    cfg = build_config([preset_data("smoke"), {"method": "internalise", "train": {"internalise_epochs": 2}}])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    internaliser = Internaliser(cfg, PolicyUpdater(model, opt, tokenizer.pad_token_id))
    kept = _rollout(tokenizer, "multiturn", guidance=LESSON, free_prompts=True)
    kept.reward, kept.group_id = 1.0, 0
    lost = _rollout(tokenizer, "multiturn", guidance=LESSON, free_prompts=True)
    lost.reward, lost.group_id = 0.0, 0
    free = _rollout(tokenizer, "multiturn")
    free.group_id = 0                                                      # free mean 0: only `kept` beats it
    last = kept.turns[-1]
    before = _seq_logprob(model, last.free_prompt_ids, last.response_ids)
    trained: list = []
    real = internaliser.updater.update
    internaliser.updater.update = lambda samples: trained.extend(samples) or real(samples)
    m = internaliser.update([free, kept, lost])
    assert (m["internalise_selected"], m["internalise_stripped"], m["internalise_optimizer_steps"]) == (1.0, 1.0, 2.0)
    (sample,) = trained                                                    # one sequence: the kept episode
    assert sample.prompt_ids == last.free_prompt_ids[:len(sample.prompt_ids)]
    assert "Push the box left" not in tokenizer.decode(sample.prompt_ids + sample.response_ids)
    assert _seq_logprob(model, last.free_prompt_ids, last.response_ids) > before
    tokens = sum(len(t.response_ids) for t in kept.turns)
    assert m["internalise_nll"] > 0 and m["internalise_trained_tokens"] == 2 * tokens          # 2 passes
    assert internaliser.update([free, lost])["internalise_optimizer_steps"] == 0.0     # nothing kept: no step


def test_the_method_wires_internalisation_into_the_step(tokenizer, tiny_model):
    from test_memory_controls import _diag_trainer

    from crl_bench.methods import get_method

    assert get_method("internalise").internalises and get_method("internalise").trains_extractor
    tr = _diag_trainer(tokenizer, tiny_model, method="internalise")
    assert tr.runner.free_prompts and tr.internaliser is not None
    m = tr.train_step().metrics
    assert {"internalise_selected", "internalise_stripped", "internalise_optimizer_steps"} <= set(m)
    state = tr.state_dict()
    assert "internaliser" in state
    tr.load_state_dict(state)
    tr.close()
    from tests_helpers import coin_config

    from crl_bench.config import ConfigError
    from crl_bench.trainer.policy import PolicyUpdater

    cfg = coin_config("internalise", train={"workers": 2})
    with pytest.raises(ConfigError, match="train.workers"):
        Internaliser(cfg, PolicyUpdater(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), 0))


def test_turns_without_responses_are_left_out():
    t = Trajectory("e", 0, 0, "guided", reward=1.0, guidance="x")
    t.turns = [Turn([1, 2], [], [], None, True, 0.0, free_prompt_ids=[1])]
    assert stripped(t) is not None and stripped(t).turns[0].prompt_ids == [1]
