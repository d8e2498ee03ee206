"""The extractor's warm start: supervised fine-tuning on a scripted teacher's replies, graded on held-out
episodes (``crl-bench extractor sft``; docs/method.md "Warm-starting the extractor").

The paper's extractor (Qwen3-4B-Thinking, arXiv 2603.17621; docs/method.md "In short") starts able to write a useful
lesson; the default 135M one does not (1 correct lesson in 540 on ``diag-vault``, docs/diagnostics.md),
so CISPO on its use reward has nothing to reinforce.  A warm start gives the co-evolution study an
extractor that can write: examples of practice contexts (:mod:`crl_bench.trainer.warm_start_data`),
rendered with the loop's own extractor prompt (:func:`crl_bench.experience.extractor.extractor_for` on
the run's ``extractor`` settings: format, transcript, prompt budget) and answered in the reply format the
loop parses, fine-tune the extractor model (all weights, or LoRA adapters through peft) with the
cross-entropy of the reply tokens only; then the extractor, sampling as in the loop, answers held-out
episodes of the env's own contexts, and :meth:`DiagEnv.grade_lesson` says whether each lesson it wrote
is correct.

* :func:`render_examples` turns teacher items into ``(prompt ids, reply ids)``;
* :func:`finetune` runs the updates and calls back at the grading points;
* :func:`grade_extractor` measures an extractor on held-out items;
* :func:`warm_start` does all of it for a run config and writes the folder ``--extractor-model`` loads.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crl_bench.experience.extractor import Extractor, extractor_for
from crl_bench.experience.json_ops import format_json_operations
from crl_bench.experience.operations import format_operations
from crl_bench.experience.types import Operation
from crl_bench.trainer.policy import (
    TokenSample,
    build_batch,
    common_prefix_length,
    linear_warmup,
    sequence_logprobs,
    shared_prefix_logprobs,
)
from crl_bench.trainer.warm_start_data import DIAG_TEACHERS, teacher_items
from crl_bench.trainer.warm_start_items import TeacherItem

__all__ = ["SFTExample", "reply_text", "render_examples", "finetune", "grade_extractor", "warm_start",
           "LESSON_KINDS"]

#: operation kinds that write a lesson
LESSON_KINDS = ("ADD", "UPDATE", "MERGE")
#: replies generated at once when grading
GRADE_BATCH = 16


@dataclass
class SFTExample:
    """One fine-tuning example: the extractor's prompt (prefill included) and the teacher's reply.

    Attributes:
        prompt_ids: length P, never trained.
        reply_ids: length R >= 1, the tokens the extractor should generate after the prompt.
        item: the teacher item it was rendered from.
    """

    prompt_ids: list[int]
    reply_ids: list[int]
    item: TeacherItem


def reply_text(ops: Sequence[Operation], shown_ids: Sequence[int], fmt: str, prefill: str, one_op: bool) -> str:
    """What the extractor should generate after its prompt for ``ops``, in the loop's reply format.

    ``line``: the one-line format (:func:`~crl_bench.experience.operations.format_operations`) after the
    prompt's ``prefill``; with ``one_op`` (``extractor.one_op_per_reply``) up to the end of the first
    operation's line, the newline included (the loop stops generating there).  ``json``: the released
    answer (:func:`~crl_bench.experience.json_ops.format_json_operations`), targets numbered as shown.

    Raises:
        ValueError: an unknown ``fmt``, or a line-format reply that does not start with ``prefill``.
    """
    if fmt not in ("line", "json"):
        raise ValueError(f"extractor format must be line or json, got {fmt!r}")
    full = format_json_operations(ops, shown_ids) if fmt == "json" else format_operations(ops)
    if not full.startswith(prefill):
        raise ValueError(f"the reply {full[:40]!r} does not start with the prompt's prefill {prefill!r}")
    rest = full[len(prefill):]
    if one_op and fmt == "line":
        rest = rest[:rest.index("\n") + 1]
    return rest


def render_examples(extractor: Extractor, items: Sequence[TeacherItem], fmt: str, one_op: bool) -> list[SFTExample]:
    """The fine-tuning examples of ``items``: each episode and its shown entries in the extractor's prompt
    (:meth:`ExtractorPromptBuilder.prepare`, as the loop builds it) and the teacher's reply.  An item whose
    entries do not all fit the prompt budget is left out (its reply may name an entry the prompt lost).
    ``json`` replies end with the tokenizer's end-of-sequence token (the loop's json extractor stops there)."""
    tok = extractor.tokenizer
    out = []
    for it in items:
        prompt_ids, shown, _ = extractor.prompts.prepare(it.record, it.shown)
        if len(shown) < len(it.shown):
            continue
        text = reply_text(it.ops, [e.id for e in shown], fmt, extractor.prompts.prefill, one_op)
        ids = tok.encode(text, add_special_tokens=False)
        if fmt == "json" and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
        out.append(SFTExample(list(prompt_ids), ids, it))
    return out


def finetune(model: Any, examples: Sequence[SFTExample], *, steps: int, batch_size: int, micro_batch_size: int,
             lr: float, pad_id: int, seed: int = 0, warmup_steps: int = 0, max_grad_norm: float = 1.0,
             compute_dtype: torch.dtype | None = None,
             on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Fine-tune ``model`` on ``examples`` with the mean cross-entropy of the reply tokens (AdamW).

    Batches of ``batch_size`` examples are drawn in a seeded order, a new shuffle per pass over the
    examples; each is run in micro-batches of ``micro_batch_size`` and the loss is the mean over all
    reply tokens of the batch.  The prompt prefix a micro-batch shares (the extractor's instructions
    and worked example, about three quarters of a diagnostic prompt) is computed once
    (:func:`~crl_bench.trainer.policy.shared_prefix_logprobs`; same loss and gradient).

    Args:
        model: a causal LM (or a peft model) in train-ready state; only parameters with
            ``requires_grad`` are updated.
        examples: at least one.
        steps: optimizer steps (0: none).
        batch_size, micro_batch_size: examples per step and per forward/backward.
        lr: learning rate, reached after ``warmup_steps`` linear warm-up steps.
        pad_id: the tokenizer's pad id.
        seed: seed of the order.
        max_grad_norm: gradient-norm clip.
        compute_dtype: autocast dtype of the forward (``None``: the weights').
        on_step: called after each step with the 1-based step and its metrics.

    Returns:
        Per step: ``{"step", "loss" (nats per reply token), "grad_norm", "tokens", "seconds"}``.

    Raises:
        ValueError: no examples, or a size below 1.
    """
    if not examples:
        raise ValueError("no fine-tuning examples")
    if batch_size < 1 or micro_batch_size < 1 or steps < 0:
        raise ValueError(f"need batch_size, micro_batch_size >= 1 and steps >= 0, got {batch_size}, "
                         f"{micro_batch_size}, {steps}")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = linear_warmup(optimizer, warmup_steps) if warmup_steps else None
    rng = random.Random(seed)
    order: list[int] = []
    history = []
    model.train()
    device = next(model.parameters()).device
    for step in range(1, steps + 1):
        start = time.perf_counter()
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        tokens = sum(len(e.reply_ids) for e in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(batch), micro_batch_size):
            chunk = batch[i:i + micro_batch_size]
            samples = [TokenSample(e.prompt_ids, e.reply_ids, [0.0] * len(e.reply_ids), 0.0) for e in chunk]
            # the prompts share the extractor's instructions and worked example: computed once per chunk
            shared = min(common_prefix_length(samples), min(len(x.prompt_ids) for x in samples) - 1)
            if shared > 0 and not getattr(model, "is_gradient_checkpointing", False):
                logprobs, b = shared_prefix_logprobs(model, samples, shared, pad_id, 1.0, compute_dtype, device)
            else:
                b = build_batch(samples, pad_id, device)
                logprobs = sequence_logprobs(model, b, 1.0, compute_dtype)
            loss = -(logprobs * b["mask"]).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        optimizer.step()
        if schedule is not None:
            schedule.step()
        m = {"step": step, "loss": total, "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
             "tokens": tokens, "seconds": time.perf_counter() - start}
        history.append(m)
        if on_step is not None:
            on_step(step, m)
    model.eval()
    return history


def _writes(op: Operation) -> bool:
    return op.kind in LESSON_KINDS


def grade_extractor(extractor: Extractor, items: Sequence[TeacherItem], grader: Callable[[TeacherItem], Any]
                    ) -> dict[str, Any]:
    """How ``extractor`` answers held-out ``items`` (one sampled reply each, the extractor's sampling).

    Args:
        extractor: the extractor as the loop builds it.
        items: held-out teacher items (:func:`diag_items`: the env's own contexts, or practice worlds
            the examples did not use).
        grader: the env whose :meth:`grade_lesson` judges a lesson of an item (the item's world), or
            ``None`` for an env without a judge of its lessons: then ``lesson_correct`` and
            ``wrong_lessons`` are NaN and ``agreement`` counts the operation's kind and targets only.

    Returns:
        ``episodes``; ``lesson_episodes`` (items where the teacher writes a lesson: successes without a
        shown correct lesson); ``lesson_correct`` (share of those where the reply writes a lesson that
        states the context's whole solution: the warm start's competence); ``wrong_lessons`` (share of
        all replies that write a lesson that is not correct for the episode's context); ``agreement``
        (share of replies whose first operation is the teacher's: same kind and targets, and for a
        lesson a correct one); ``valid`` (share of replies with a valid operation); ``replies`` (the first
        20 replies with their context and the teacher's kind, for reading).
    """
    records = [it.record for it in items]
    extractions = extractor.extract(records, [it.shown for it in items])
    lesson_n = correct = wrong = agree = valid = 0
    judged = True                           # every item's lessons have a judge
    shown = []
    for it, ex in zip(items, extractions):
        ops = list(ex.parse.ops)
        valid += bool(ex.parse.ok)
        written = [op for op in ops if _writes(op)]
        env = grader(it)
        judged = judged and env is not None
        good = [op for op in written if env is None
                or env.grade_lesson(f"{op.title} {op.content}", it.context)["correct"]]
        wrong += len(written) > len(good)
        teacher = it.ops[0]
        if _writes(teacher):
            lesson_n += 1
            correct += bool(good)
        first = ops[0] if ops else None
        if first is not None and first.kind == teacher.kind and tuple(first.targets) == tuple(teacher.targets):
            agree += (not _writes(first)) or bool(good)
        if len(shown) < 20:
            shown.append({"context": it.context, "success": it.record.success, "teacher": teacher.kind,
                          "reply": ex.text})
    n = len(items)
    nan = float("nan")
    return {"episodes": n, "lesson_episodes": lesson_n,
            "lesson_correct": correct / lesson_n if lesson_n and judged else nan,
            "wrong_lessons": wrong / n if n and judged else nan, "agreement": agree / n if n else nan,
            "valid": valid / n if n else nan, "replies": shown}


def _save(model: Any, tokenizer: Any, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def warm_start(cfg: Any, env_id: str, out: str | Path, *, examples: int = 2048, worlds: int = 64, steps: int = 200,
               batch_size: int = 16, lr: float = 5e-5, lora_rank: int = 0, heldout: int = 128,
               warmup_steps: int = 8, grade_every: int = 0, grade_at: Sequence[int] = (), save_graded: bool = False,
               seed: int = 0,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Warm-start the extractor of ``cfg`` on teacher examples of ``env_id`` and write it to ``out``.

    The extractor model is ``cfg.extractor.model`` (``same``: the actor's ``cfg.model.name``), loaded in
    float32 (the forward under the config's compute dtype); the prompt and reply format are those
    :func:`extractor_for` builds from ``cfg.extractor``.  Examples: ``examples`` teacher items
    (:func:`~crl_bench.trainer.warm_start_data.teacher_items`; for a diagnostic, over ``worlds`` practice
    worlds, none of the env's own contexts).  Before the first step, every ``grade_every`` steps, at the
    steps of ``grade_at`` and after the last, the extractor answers two held-out sets of ``heldout``
    episodes each and is graded on both
    (:func:`grade_extractor`): ``validation``, by which a checkpoint is picked (a diagnostic's: 16 practice
    worlds the examples never used); ``heldout``, reported and never used to pick anything (a
    diagnostic's: its own contexts, the ``eval`` and ``eval_unseen`` tasks).  The games' parts play
    ``train`` tasks with their own seeds, and their lessons have no judge (agreement and validity only).
    A step's examples go through one forward and backward (their shared prompt prefix
    computed once).

    Writes ``out/`` (the fine-tuned model, or its LoRA adapters, and tokenizer: what
    ``--extractor-model out`` loads), ``out/warm_start.json`` (settings, the grades, the loss per step),
    and with ``save_graded`` a folder ``out/step-N`` per grading point.

    The learning rate rises linearly over ``warmup_steps`` steps (0: none), then stays at ``lr``.  ``log``
    receives each progress line (default: printed and flushed).

    Returns:
        The ``warm_start.json`` record.

    Raises:
        ValueError: ``env_id`` has no teacher, or a setting is out of range.
        ModelNotAvailable: the extractor model cannot be loaded.
    """
    from crl_bench.env_api import make_env
    from crl_bench.llm.hf_engine import HFEngine, load_model_and_tokenizer
    from crl_bench.llm.precision import DTYPES, resolve_dtype

    if log is None:
        def log(msg: str) -> None:          # flushed: a background run's log file shows each line as it comes
            print(msg, flush=True)

    if (examples < 1 or worlds < 1 or heldout < 0 or grade_every < 0 or lora_rank < 0 or warmup_steps < 0
            or any(k < 1 for k in grade_at)):
        raise ValueError("examples and worlds must be >= 1; heldout, grade_every, lora_rank and warmup_steps "
                         ">= 0; grade_at steps >= 1")
    out = Path(out)
    xc = cfg.extractor
    env_kwargs = dict(cfg.rollout.env_kwargs.get(env_id, {}))
    name = cfg.model.name if xc.model == "same" else xc.model
    torch.manual_seed(seed)
    model, tokenizer = load_model_and_tokenizer(name, dtype="float32")
    compute_dtype = DTYPES[resolve_dtype(cfg.model.dtype, next(model.parameters()).device)]
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    # grading generates at most GRADE_BATCH replies at a time: a diag preset's batch of 128 prompts of
    # 1,000 tokens holds gigabytes of key-value cache beside the optimizer's state
    engine = HFEngine(model, tokenizer, batch_size=min(cfg.generation.batch_size, GRADE_BATCH),
                      prefix_cache=cfg.generation.prefix_cache, compute_dtype=compute_dtype,
                      cache_mb=cfg.generation.cache_mb)
    extractor = extractor_for(xc, engine, tokenizer)
    part_kw = {"worlds": worlds, "env_kwargs": env_kwargs, "max_steps": cfg.rollout.max_steps or None}
    train_items = teacher_items(env_id, examples, seed, "train", **part_kw)
    held_items = teacher_items(env_id, heldout, seed, "heldout", **part_kw)
    val_items = teacher_items(env_id, heldout, seed, "validation", **part_kw)
    graders: dict[int | None, Any] = {}

    def grader(item: TeacherItem) -> Any:
        if env_id not in DIAG_TEACHERS:
            return None                     # no judge of a room's lessons: agreement and validity only
        if item.world not in graders:
            extra = {} if item.world is None else {"practice_world": item.world}
            graders[item.world] = make_env(env_id, **env_kwargs, **extra)
        return graders[item.world]
    train = render_examples(extractor, train_items, xc.format, xc.one_op_per_reply)
    log(f"warm start of {name!r} on {env_id}: {len(train)} examples, {len(val_items)} validation and "
        f"{len(held_items)} held-out episodes")
    grades: list[dict[str, Any]] = []

    def share(v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.3f}"         # NaN: no episode to take a share of

    def grade(step: int) -> None:
        if not held_items:
            return
        model.eval()
        torch.manual_seed(seed + 7 * step + 1)
        engine.sync_weights(model)
        g = {"step": step, "validation": grade_extractor(extractor, val_items, grader),
             "heldout": grade_extractor(extractor, held_items, grader)}
        grades.append(g)
        for part in ("validation", "heldout"):
            r = g[part]
            judged = ("lessons not judged (no judge for this env)" if math.isnan(r["wrong_lessons"]) else
                      f"correct lessons {share(r['lesson_correct'])} of {r['lesson_episodes']} lesson episodes, "
                      f"wrong lessons {share(r['wrong_lessons'])}")
            log(f"step {step} {part}: {judged}, agreement {r['agreement']:.3f}, valid {r['valid']:.3f}")
        if save_graded:
            _save(model, tokenizer, out / f"step-{step}")
        engine.sync_weights(model)          # drops the cached prefixes until the next grading
        model.train()

    def on_step(step: int, m: dict[str, float]) -> None:
        if step % 10 == 0 or step == steps:
            log(f"step {step}/{steps}: loss {m['loss']:.4f} ({m['seconds']:.1f} s)")
        if ((grade_every and step % grade_every == 0) or step in grade_at) and step != steps:
            grade(step)

    started = time.perf_counter()
    grade(0)
    history = finetune(model, train, steps=steps, batch_size=batch_size, micro_batch_size=batch_size,
                       lr=lr, pad_id=tokenizer.pad_token_id, seed=seed, warmup_steps=warmup_steps,
                       compute_dtype=compute_dtype, on_step=on_step)
    if steps:
        grade(steps)
    _save(model, tokenizer, out)
    kinds: dict[str, int] = {}
    for e in train:
        kinds[e.item.ops[0].kind] = kinds.get(e.item.ops[0].kind, 0) + 1
    record = {"env": env_id, "env_kwargs": env_kwargs, "base_model": name, "lora_rank": lora_rank,
              "examples": len(train), "teacher_ops": kinds, "worlds": worlds, "steps": steps,
              "batch_size": batch_size, "lr": lr, "warmup_steps": warmup_steps, "seed": seed,
              "heldout": len(held_items),
              "grade_every": grade_every, "grade_at": sorted(set(grade_at)),
              "extractor": {"format": xc.format, "transcript": xc.transcript, "max_prompt_tokens": xc.max_prompt_tokens,
                            "one_op_per_reply": xc.one_op_per_reply, "temperature": xc.temperature},
              "seconds": round(time.perf_counter() - started, 1), "grades": grades,
              "loss": [round(m["loss"], 5) for m in history]}
    (out / "warm_start.json").write_text(json.dumps(record, indent=1) + "\n")
    return record
