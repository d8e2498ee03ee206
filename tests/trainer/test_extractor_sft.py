"""The extractor warm start (trainer/warm_start_data.py, trainer/extractor_sft.py, ``crl-bench extractor sft``):
the teacher's answers, examples in the loop's exact prompt and reply format with no real context in them,
the fine-tuning loss, the held-out grade, and a folder that ``--extractor-model`` loads."""

from __future__ import annotations

import json
import math

import pytest

from crl_bench.cli import main
from crl_bench.config import build_config, preset_data
from crl_bench.envs.diag import CONTEXT_NAMES, DIAG_SPLITS, N_CONTEXTS, DiagCorridorEnv, DiagVaultEnv
from crl_bench.experience.extractor import extractor_for
from crl_bench.experience.json_ops import parse_json_operations
from crl_bench.experience.operations import parse_operations
from crl_bench.experience.types import ExperienceEntry, Operation
from crl_bench.trainer.extractor_sft import finetune, grade_extractor, render_examples, reply_text
from crl_bench.trainer.warm_start_data import diag_items, diag_teacher_ops

TASK = 40 * N_CONTEXTS + 3        # a train task of context 3


def _entry(i, env, task, actions):
    return ExperienceEntry(i, env.env_id, env.context(task), env.lesson_for(task, actions))


# ---- the teacher ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [DiagVaultEnv, DiagCorridorEnv], ids=["vault", "corridor"])
def test_teacher_writes_the_lesson_a_success_holds_and_votes_on_shown_lessons(cls):
    env = cls(practice_world=2)
    solution = env.solution(TASK)
    wrong = ["left"] * len(solution) if env.env_id == "diag-corridor" else ["anchor"]
    if wrong == solution:
        wrong = ["right"] * len(solution) if env.env_id == "diag-corridor" else ["bell"]
    right_e, wrong_e = _entry(11, env, TASK, solution), _entry(12, env, TASK, wrong)
    other = _entry(13, env, TASK + 1, env.solution(TASK + 1))

    (add,) = diag_teacher_ops(env, TASK, True, solution, [])
    assert add.kind == "ADD" and env.grade_lesson(f"{add.title} {add.content}", env.context(TASK))["correct"]
    assert diag_teacher_ops(env, TASK, True, solution, [other])[0].kind == "ADD"     # another context's lesson
    assert diag_teacher_ops(env, TASK, True, solution, [right_e]) == [Operation("UPVOTE", targets=(11,))]
    (upd,) = diag_teacher_ops(env, TASK, True, solution, [wrong_e])
    assert upd.kind == "UPDATE" and upd.targets == (12,) and upd.content == add.content
    # a failure that followed a wrong lesson of its context: downvote it; any other failure: nothing
    assert diag_teacher_ops(env, TASK, False, wrong[:1], [wrong_e]) == [Operation("DOWNVOTE", targets=(12,))]
    assert diag_teacher_ops(env, TASK, False, wrong[:1], []) == [Operation("NONE")]
    assert diag_teacher_ops(env, TASK, False, wrong[:1], [right_e]) == [Operation("NONE")]


def test_practice_items_never_show_a_real_context_and_heldout_items_are_the_eval_tasks():
    items = diag_items("diag-vault", 200, seed=0, world=0, worlds=8)
    kinds = {it.ops[0].kind for it in items}
    assert {"ADD", "UPVOTE", "DOWNVOTE", "NONE"} <= kinds
    assert 0.2 < sum(it.record.success for it in items) / len(items) < 0.7
    for it in items:
        text = repr(it.record) + repr(it.shown) + repr(it.ops)
        assert not any(name in text for name in CONTEXT_NAMES), text
        assert it.record.task_prompt.endswith(f"{it.context}.")
    held = diag_items("diag-corridor", 60, seed=1, world=None)
    eval_tasks = set(DIAG_SPLITS["eval"]) | set(DIAG_SPLITS["eval_unseen"])
    assert all(it.context in CONTEXT_NAMES and it.world is None for it in held)
    assert {it.record.source[0] for it in held} == set(range(60))
    env = DiagCorridorEnv()
    assert all(any(env.context(t) == it.context for t in eval_tasks) for it in held)
    assert diag_items("diag-vault", 30, seed=3, world=0) == diag_items("diag-vault", 30, seed=3, world=0)
    with pytest.raises(ValueError, match="no practice worlds"):
        diag_items("minihack-room", 1, seed=0)
    from crl_bench.trainer.warm_start_data import teacher_items

    with pytest.raises(ValueError, match="no warm-start teacher"):
        teacher_items("webshop", 1, 0, "train")
    with pytest.raises(ValueError, match="part must be"):
        teacher_items("diag-vault", 1, 0, "test")


# ---- the examples: the loop's prompt, the loop's reply format ---------------------------------------------
def test_reply_text_parses_back_to_the_teachers_operations():
    ops = [Operation("ADD", "Zanarth Priory", "In the Zanarth Priory, turn the dial to the moon.")]
    line = reply_text(ops, [], "line", "<ops>\n<op>", one_op=True)
    assert line.endswith("</content>\n") and "</ops>" not in line
    assert parse_operations("<ops>\n<op>" + line, 3).ops == ops
    vote = [Operation("DOWNVOTE", targets=(42,))]
    assert parse_json_operations(reply_text(vote, [7, 42], "json", "", one_op=True), [7, 42]).ops == vote
    assert parse_json_operations(reply_text([Operation("NONE")], [], "json", "", True), []).ops == [Operation("NONE")]
    with pytest.raises(ValueError):
        reply_text(ops, [], "yaml", "", True)


@pytest.mark.parametrize("fmt", ["line", "json"])
def test_examples_are_the_loops_prompt_and_a_reply_it_parses(tokenizer, fmt):
    cfg = build_config([preset_data("diag"), {"extractor": {"format": fmt}}])
    extractor = extractor_for(cfg.extractor, None, tokenizer)
    items = diag_items("diag-vault", 24, seed=0, world=0, worlds=3)
    examples = render_examples(extractor, items, fmt, cfg.extractor.one_op_per_reply)
    assert len(examples) == len(items)
    for ex in examples:
        it = ex.item
        assert ex.prompt_ids == extractor.prompts.build(it.record, it.shown)
        reply = tokenizer.decode(ex.reply_ids, skip_special_tokens=True)
        parsed = extractor._parse(extractor.prompts.prefill + reply, [e.id for e in it.shown])
        assert parsed.ok and parsed.ops == it.ops, reply


# ---- fine-tuning and grading -----------------------------------------------------------------------------
def test_finetune_raises_the_teachers_reply_and_only_trains_reply_tokens(tiny_model_dir):
    import torch

    from crl_bench.llm.hf_engine import load_model_and_tokenizer
    from crl_bench.trainer.policy import TokenSample, build_batch, sequence_logprobs

    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    cfg = build_config([preset_data("diag")])
    extractor = extractor_for(cfg.extractor, None, tok)
    examples = render_examples(extractor, diag_items("diag-vault", 4, seed=0, world=0), "line", True)

    def reply_logprob():
        samples = [TokenSample(e.prompt_ids, e.reply_ids, [0.0] * len(e.reply_ids), 0.0) for e in examples]
        b = build_batch(samples, tok.pad_token_id)
        with torch.no_grad():
            return float((sequence_logprobs(model, b) * b["mask"]).sum() / b["mask"].sum())

    before = reply_logprob()
    history = finetune(model, examples, steps=4, batch_size=4, micro_batch_size=2, lr=5e-3,
                       pad_id=tok.pad_token_id, seed=0)
    assert [m["step"] for m in history] == list(range(1, 5))
    assert all(m["tokens"] == sum(len(e.reply_ids) for e in examples) for m in history)
    assert reply_logprob() > before + 1.0
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    with pytest.raises(ValueError):
        finetune(model, [], steps=1, batch_size=1, micro_batch_size=1, lr=1e-3, pad_id=0)


class _ScriptedReplies:
    """An extractor engine that answers each prompt with ``answer(prompt text)`` (placeholder log-probs)."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer

    def generate(self, prompts, params, allowed=None):
        from crl_bench.llm.base import Generation

        out = []
        for p in prompts:
            text = self.answer(self.tokenizer.decode(p))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-1.0] * len(ids), text, "stop"))
        return out


def test_grade_counts_correct_and_wrong_lessons_against_the_real_contexts(tokenizer):
    import re

    cfg = build_config([preset_data("diag")])
    env = DiagVaultEnv()
    held = diag_items("diag-vault", 64, seed=5, world=None)
    by_prompt = {}

    def teacher(prompt):             # answers as the teacher would: every grade is perfect
        ctx = re.findall(r"Task: Open the vault of the (.+?)\.", prompt)[-1]
        return by_prompt[ctx]

    def liar(prompt):                # always a lesson, always the wrong code
        ctx = re.findall(r"Task: Open the vault of the (.+?)\.", prompt)[-1]
        task = DIAG_SPLITS["eval"][0] - DIAG_SPLITS["eval"][0] % N_CONTEXTS + CONTEXT_NAMES.index(ctx)
        wrong = next(a for a in ("anchor", "bell") if a != env.solution(task)[0])
        return f"ADD</op><title>{ctx}</title><content>{env.lesson_for(task, [wrong])}</content>\n"

    perfect = extractor_for(cfg.extractor, _ScriptedReplies(tokenizer, teacher), tokenizer)
    one = [it for it in held if it.ops[0].kind == "ADD"][:1]
    by_prompt[one[0].context] = reply_text(one[0].ops, [], "line", "<ops>\n<op>", True)
    g = grade_extractor(perfect, one, lambda _item: env)
    assert (g["lesson_correct"], g["agreement"], g["wrong_lessons"], g["valid"]) == (1.0, 1.0, 0.0, 1.0)

    g = grade_extractor(extractor_for(cfg.extractor, _ScriptedReplies(tokenizer, liar), tokenizer), held,
                        lambda _item: env)
    lessons = sum(it.ops[0].kind in ("ADD", "UPDATE") for it in held)
    assert g["lesson_episodes"] == lessons > 0 and g["lesson_correct"] == 0.0
    assert g["wrong_lessons"] == 1.0 and g["valid"] == 1.0 and g["episodes"] == 64


# ---- the command -----------------------------------------------------------------------------------------
def test_command_writes_a_folder_the_extractor_model_option_loads(tiny_model_dir, tmp_path, capsys):
    import argparse

    from crl_bench.commands.options import resolve_config
    from crl_bench.llm.hf_engine import load_model_and_tokenizer
    from crl_bench.trainer.extractor_sft import warm_start

    out = tmp_path / "warm"
    rc = main(["extractor", "sft", "--mix", "diag-vault", "--preset", "diag", "--model", str(tiny_model_dir),
               "--out", str(out), "--examples", "8", "--worlds", "2", "--steps", "2", "--batch-size", "2",
               "--heldout", "2", "--grade-at", "1", "--set", "extractor.max_new_tokens=8"])   # a random tiny
    # model never stops early
    assert rc == 0
    assert "correct lessons" in capsys.readouterr().out
    record = json.loads((out / "warm_start.json").read_text())
    assert record["env"] == "diag-vault" and record["steps"] == 2 and len(record["loss"]) == 2
    assert [g["step"] for g in record["grades"]] == [0, 1, 2] and record["heldout"] == 2
    assert all(g[part]["episodes"] == 2 for g in record["grades"] for part in ("validation", "heldout"))
    assert (out / "config.json").is_file()
    model, tok = load_model_and_tokenizer(str(out))
    assert tok.chat_template
    # a run config takes the folder as its extractor
    args = argparse.Namespace(preset="diag", config=None, method="complementary", mix="diag-vault", model=None,
                              seed=None, extractor_model=str(out), set=[])
    assert resolve_config(args).extractor.model == str(out)
    # LoRA: the folder holds the adapters, loaded merged into the base model; an env whose lessons have no
    # judge (sokoban) is graded on agreement and validity only
    cfg = build_config([preset_data("diag"), {"model": {"name": str(tiny_model_dir)},
                                              "extractor": {"max_new_tokens": 8}}])
    lines: list[str] = []
    soko = warm_start(cfg, "sokoban", tmp_path / "lora", examples=4, steps=1, batch_size=2, heldout=1, lora_rank=4,
                      log=lines.append)
    graded = [ln for ln in lines if " heldout: " in ln or " validation: " in ln]
    assert graded and all("not judged" in ln and "nan" not in ln for ln in graded)   # no NaN shown as a share
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    merged, _ = load_model_and_tokenizer(str(tmp_path / "lora"))
    assert not hasattr(merged, "peft_config")
    last = soko["grades"][-1]["heldout"]
    assert math.isnan(last["lesson_correct"]) and math.isnan(last["wrong_lessons"]) and 0 <= last["agreement"] <= 1
    # an existing folder is not overwritten by accident; an env without a teacher is refused
    assert main(["extractor", "sft", "--mix", "diag-vault", "--model", str(tiny_model_dir), "--out", str(out)]) == 2
    assert main(["extractor", "sft", "--mix", "webshop", "--out", str(tmp_path / "x")]) == 2
    assert main(["extractor", "sft", "--mix", "diag-vault", "--out", str(tmp_path / "y"), "--grade-at", "2,x"]) == 2
    assert "teacher" in capsys.readouterr().err


# ---- the minihack-room teacher ----------------------------------------------------------------------------
def test_room_teacher_lessons_follow_the_stairs_and_the_moves():
    from crl_bench.trainer.warm_start_minihack import MISLEADING, ROOM_LESSON, direction, room_teacher_ops

    assert direction((5, 5), (7, 8)) == "southeast" and direction((5, 5), (5, 2)) == "west"
    assert direction((5, 5), (5, 5)) == ""
    good = ExperienceEntry(7, "minihack-room", *ROOM_LESSON)
    bad = ExperienceEntry(8, "minihack-room", *MISLEADING[2])
    (add,) = room_teacher_ops(True, ["southeast", "east", "north"], (1, 1), (2, 3), [], False)
    assert add.kind == "ADD" and add.title == ROOM_LESSON[0] and "took 3 moves where 2 were enough" in add.content
    (fast,) = room_teacher_ops(True, ["southeast", "east"], (1, 1), (2, 3), [], False)
    assert "the fewest moves, 2" in fast.content
    assert room_teacher_ops(True, ["east"], (1, 1), (1, 2), [good], False) == [Operation("UPVOTE", targets=(7,))]
    (upd,) = room_teacher_ops(True, ["east"], (1, 1), (1, 2), [bad], True)
    assert upd.kind == "UPDATE" and upd.targets == (8,)
    assert room_teacher_ops(False, ["north"] * 8, (3, 3), (3, 1), [bad], True) == [Operation("DOWNVOTE", targets=(8,))]
    (lost,) = room_teacher_ops(False, ["north", "north", "east"], (3, 3), (3, 1), [], False)
    assert lost.kind == "ADD" and "to the west of the start" in lost.content and "moved north, east" in lost.content
    assert room_teacher_ops(False, ["north"], (3, 3), (3, 1), [good], False) == [Operation("NONE")]


def test_room_items_play_training_rooms_only(tokenizer):
    from crl_bench.envs.minihack.tasks import MiniHackRoomEnv
    from crl_bench.trainer.warm_start_data import teacher_items

    kwargs = {"variant": "MiniHack-Room-Random-5x5-v0", "goal_offset": True}
    items = teacher_items("minihack-room", 12, 0, "train", env_kwargs=kwargs, max_steps=8)
    eval_tasks = set(MiniHackRoomEnv.splits["eval"])
    assert all(it.meta["task"] in MiniHackRoomEnv.splits["train"] and it.meta["task"] not in eval_tasks
               for it in items)
    assert all(len(it.record.steps) <= 8 and it.record.env_id == "minihack-room" for it in items)
    assert any(it.record.success for it in items)
    for it in items:
        if it.record.success and it.ops[0].kind == "ADD":
            assert it.ops[0].title == "Walk straight to the stairs"
    cfg = build_config([preset_data("cpu")])
    extractor = extractor_for(cfg.extractor, None, tokenizer)
    for ex in render_examples(extractor, items, "line", True):
        reply = tokenizer.decode(ex.reply_ids, skip_special_tokens=True)
        assert extractor._parse(extractor.prompts.prefill + reply, [e.id for e in ex.item.shown]).ops == ex.item.ops


# ---- the sokoban teacher ----------------------------------------------------------------------------------
def test_sokoban_teacher_names_the_push_that_made_the_level_unsolvable():
    from crl_bench.envs.sokoban import EVAL_TASKS, SokobanEnv, solve
    from crl_bench.trainer.warm_start_data import teacher_items
    from crl_bench.trainer.warm_start_sokoban import MISLEADING, PLAN_LESSON, sokoban_teacher_ops

    items = teacher_items("sokoban", 60, 0, "train")
    assert {it.ops[0].kind for it in items} >= {"ADD", "UPVOTE"}
    assert any(it.record.success for it in items) and any(it.meta["dead"] for it in items)
    env = SokobanEnv()
    for it in items:
        task, dead = it.meta["task"], it.meta["dead"]
        assert task not in EVAL_TASKS
        env.reset(options={"task": task})
        moves = [step[1] for step in it.record.steps]
        for k, move in enumerate(moves):
            env.step(f"<answer>{move}</answer>")
            if dead is not None and k == dead["step"]:
                state = env.state()                 # the push the teacher names: a box there, no solution
                assert dead["cell"] in state.boxes and solve(state) is None
                assert f"Move {k + 1} pushed a box {move}" in it.ops[0].content or it.ops[0].kind != "ADD"
        if dead is None and not it.record.success:
            assert solve(env.state()) is not None   # the level was still solvable: the moves ran out
    good = ExperienceEntry(3, "sokoban", *PLAN_LESSON)
    bad = ExperienceEntry(4, "sokoban", *MISLEADING[0])
    assert sokoban_teacher_ops(True, ["up"], 1, None, 0, [good], False) == [Operation("UPVOTE", targets=(3,))]
    assert sokoban_teacher_ops(False, ["up"] * 5, 3, None, 2, [bad], True) == [Operation("DOWNVOTE", targets=(4,))]
    (waste,) = sokoban_teacher_ops(False, ["up"] * 5, 3, None, 2, [], False)
    assert "ran out after 5: 2 of them moved nothing" in waste.content and "needed 3" in waste.content
    (corner,) = sokoban_teacher_ops(False, ["up", "left"], 4, {"step": 1, "move": "left", "cell": (1, 1),
                                                              "corner": True}, 0, [], False)
    assert "Move 2 pushed a box left into the corner at row 1, column 1" in corner.content
