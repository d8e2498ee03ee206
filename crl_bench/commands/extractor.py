"""``crl-bench extractor sft --mix ENV --out DIR``: warm-start the experience extractor by fine-tuning it on a
scripted teacher's replies to practice episodes (``diag-vault``, ``diag-corridor``, ``minihack-room``,
``sokoban``), graded on held-out episodes (:mod:`crl_bench.trainer.extractor_sft`); a run then loads it with
``--extractor-model DIR``."""

from __future__ import annotations

import argparse
from pathlib import Path

from crl_bench.commands.options import add_config_args, resolve_config
from crl_bench.config import ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = "warm-start the experience extractor on a scripted teacher's lessons"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``extractor`` and its ``sft`` subcommand to the ``crl-bench`` subcommands; returns the parser."""
    x = subparsers.add_parser("extractor", help=HELP)
    xs = x.add_subparsers(dest="extractor_cmd", required=True)
    s = xs.add_parser("sft", help="fine-tune the extractor on teacher replies (docs/method.md \"Warm-starting the "
                                  "extractor\")",
                      description="Fine-tune the experience extractor (the run config's extractor.model, 'same' = "
                                  "the actor's model) on practice episodes answered by a scripted teacher "
                                  "(diag-vault, diag-corridor, minihack-room, sokoban), in the prompt and reply "
                                  "format the run's extractor settings give; grade it on held-out episodes; write "
                                  "DIR for --extractor-model DIR.")
    add_config_args(s, with_method=True)
    s.set_defaults(method="complementary")
    s.add_argument("--out", required=True, help="folder to write (the model or its LoRA adapters, the tokenizer, "
                                                "warm_start.json)")
    s.add_argument("--examples", type=int, default=2048, help="teacher examples (default 2048)")
    s.add_argument("--worlds", type=int, default=64, help="diagnostics: practice worlds the examples spread over "
                                                          "(default 64)")
    s.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    s.add_argument("--batch-size", type=int, default=16, help="examples per step (default 16)")
    s.add_argument("--lr", type=float, default=5e-5, help="learning rate (default 5e-5)")
    s.add_argument("--warmup-steps", type=int, default=8, help="linear learning-rate warm-up steps (default 8)")
    s.add_argument("--lora-rank", type=int, default=0, help="LoRA rank; 0 (default) fine-tunes all weights")
    s.add_argument("--heldout", type=int, default=128,
                   help="episodes graded in each held-out set: unused practice worlds (validation) and the env's own "
                        "contexts (default 128)")
    s.add_argument("--grade-every", type=int, default=0, help="also grade every N steps (default: before and "
                                                              "after only)")
    s.add_argument("--grade-at", default="", metavar="N,N,...", help="also grade at these steps (e.g. 2,4,6)")
    s.add_argument("--save-graded", action="store_true", help="keep the model of every grading point in DIR/step-N")
    s.add_argument("--force", action="store_true", help="write into an existing DIR")
    return x


def run(args: argparse.Namespace) -> int:
    """Run the warm start; returns 0.

    Raises:
        ConfigError: the env has no teacher, the mix names more than one env, a setting is out of range,
            or ``--out`` exists without ``--force``.
    """
    from crl_bench.mixtures import resolve_mixture
    from crl_bench.trainer.warm_start_data import TEACHERS

    cfg = resolve_config(args)
    envs = resolve_mixture(cfg.rollout.mix).envs
    if len(envs) != 1 or envs[0] not in TEACHERS:
        raise ConfigError(f"--mix {cfg.rollout.mix!r}: the warm start needs one env with a teacher, one of "
                          f"{', '.join(TEACHERS)}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"--out {out} exists and is not empty; pass --force to write into it")
    for name in ("examples", "worlds", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("steps", "heldout", "grade_every", "lora_rank", "warmup_steps"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    try:
        grade_at = [int(k) for k in args.grade_at.split(",") if k.strip()]
    except ValueError:
        raise ConfigError(f"--grade-at {args.grade_at!r}: expected step numbers separated by commas") from None
    if any(k < 1 for k in grade_at):
        raise ConfigError(f"--grade-at {args.grade_at!r}: steps start at 1")
    from crl_bench.trainer.extractor_sft import warm_start

    record = warm_start(cfg, envs[0], out, examples=args.examples, worlds=args.worlds, steps=args.steps,
                        batch_size=args.batch_size, lr=args.lr, lora_rank=args.lora_rank, heldout=args.heldout,
                        warmup_steps=args.warmup_steps,
                        grade_every=args.grade_every, grade_at=grade_at, save_graded=args.save_graded,
                        seed=cfg.train.seed)
    last = record["grades"][-1]["heldout"] if record["grades"] else None
    if last is not None:
        judged = (f"{last['lesson_correct']:.3f} correct lessons ({last['lesson_episodes']} lesson episodes), "
                  f"{last['wrong_lessons']:.3f} wrong, " if last["lesson_correct"] == last["lesson_correct"] else "")
        print(f"held-out: {judged}{last['agreement']:.3f} agree with the teacher, {last['valid']:.3f} valid; "
              f"wrote {out} (use --extractor-model {out})")
    else:
        print(f"wrote {out} (use --extractor-model {out})")
    return 0
