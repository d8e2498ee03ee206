"""Evaluation as one stream (``eval.stream``): every mode's episodes in one continuous-batching queue give
the same episodes and the same numbers as each mode's own pass in waves, on an actor whose replies do
not depend on the batch; the progress counts the whole stream and the batches stay full; the same
evaluation run again gives the same blocks."""

from __future__ import annotations

import dataclasses

from test_memory_controls import _diag_trainer
from tests_helpers import PromptHashEngine


def _record(t):
    return (t.env_id, t.task, t.subgroup, t.reward, t.success, t.steps, t.invalid_actions, t.terminated,
            t.truncated, t.error, t.guidance, t.experience_ids, t.final_obs, t.query,
            [(x.prompt_ids, x.response_ids, x.action, x.reward, x.observation, x.experience_ids) for x in t.turns])


def test_the_stream_gives_the_per_mode_passes_episodes_and_numbers(tokenizer, tiny_model):
    tr = _diag_trainer(tokenizer, tiny_model, eval={"episodes": 4}, rollout={"max_concurrent": 3},
                       experience={"top1_demote_p": 0.5, "oversample": 4})
    tr.train_step()
    # the real (tiny) actor with its prefix store: the same evaluation again gives the same episodes
    # (each evaluation starts from an empty store), so `crl-bench eval` reproduces eval.json
    first, again = tr.evaluator.evaluate_all(), tr.evaluator.evaluate_all()
    assert all({k: v for k, v in first[m].items() if k != "wall_s"} == {k: v for k, v in again[m].items()
               if k != "wall_s"} for m in tr.evaluator.modes)
    engine = tr.runner.engine = PromptHashEngine(tokenizer)
    episodes: dict[str, list] = {}
    real_block = tr.evaluator._block

    def block(plan, tasks, trajs, *rest):
        episodes[plan["mode"]] = [_record(t) for t in trajs]
        return real_block(plan, tasks, trajs, *rest)

    tr.evaluator._block = block
    calls: list[int] = []
    real_streams = tr.runner.collect_streams

    def collect_streams(streams, *a, **kw):
        calls.append(len(streams))
        return real_streams(streams, *a, **kw)

    tr.runner.collect_streams = collect_streams
    out = {}
    for stream in (False, True):
        tr.cfg.eval = dataclasses.replace(tr.cfg.eval, stream=stream)
        engine.batches.clear()
        ticks: list[int] = []
        ev = tr.evaluator.evaluate_all(progress=ticks.append)
        assert sum(ticks) == tr.evaluator.episode_count() == 16
        out[stream] = ({m: {k: v for k, v in ev[m].items() if k != "wall_s"} for m in tr.evaluator.modes},
                       dict(episodes), list(engine.batches))
    (before, eps_before, waves), (after, eps_after, stream_batches) = out[False], out[True]
    assert calls == [1, 1, 1, 1, 4]                  # a pass per mode, then the four modes in one queue
    assert after == before and eps_after == eps_before
    assert sum(1 for m in eps_after["guided"] if m[11]) > 0          # guided episodes were shown entries
    # the stream's batches are full (3) until its queue runs dry; each mode's waves end in smaller ones
    full = len(stream_batches) - next(i for i, b in enumerate(reversed(stream_batches)) if b == 3)
    assert all(b == 3 for b in stream_batches[:full]) and len(stream_batches) < len(waves)
    tr.close()
