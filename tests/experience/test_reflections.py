"""Reflexion's reflections: the block shown to an attempt, the reflection prompt, the writer and their
storage per task in the bank (crl_bench/experience/reflections.py)."""

from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.extractor import EpisodeRecord
from crl_bench.experience.reflections import (
    REFLECTIONS_HEADER,
    ReflectionPromptBuilder,
    ReflectionWriter,
    reflection_block,
)
from crl_bench.llm.base import Generation


def test_block_lists_the_reflections_oldest_first():
    assert reflection_block([]) == reflection_block(["  "]) == ""
    assert reflection_block(["Went west.\nGo north.", "Go north at once."]) == \
        f"{REFLECTIONS_HEADER}\n\nAttempt 1: Went west. Go north.\nAttempt 2: Go north at once."


def test_bank_keeps_reflections_per_task_and_shows_the_most_recent(tmp_path):
    bank = ExperienceBank(tmp_path / "b.sqlite", HashEmbedder(16))
    bank.add_reflections([("room", 1, "first", 1), ("room", 2, "other task", 1), ("room", 1, "second", 2),
                          ("maze", 1, "other env", 2), ("room", 1, "third", 3), ("room", 1, "fourth", 4)])
    assert bank.reflections("room", 1, limit=3) == ["second", "third", "fourth"]
    assert bank.reflections("room", 2) == ["other task"] and bank.reflections("maze", 1) == ["other env"]
    assert bank.reflections("room", 9) == [] and bank.reflection_count() == 6 == bank.stats()["reflections"]
    bank.close()
    ro = ExperienceBank.open_readonly(tmp_path / "b.sqlite")
    assert ro.reflections("room", 1, limit=1) == ["fourth"]
    ro.close()


def _record(n_steps):
    steps = [("You are in a room.", "west", "You bump into a wall.")] * n_steps
    return EpisodeRecord(env_id="room", task_prompt="Reach the stairs.", steps=steps, success=False, reward=0.0)


def test_prompt_holds_the_task_the_trajectory_and_the_outcome_within_budget(tokenizer):
    b = ReflectionPromptBuilder(tokenizer, max_prompt_tokens=300)
    text = tokenizer.decode(b.build(_record(2)))
    assert "Task: Reach the stairs." in text and "Step 1: west" in text and "Outcome: failure" in text
    assert len(b.build(_record(200))) <= 300


class _Echo:
    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.params = tokenizer, reply, None

    def generate(self, prompts, params, allowed=None):
        self.params = params
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        return [Generation(list(p), ids, [-1.0] * len(ids), self.reply, "stop") for p in prompts]


def test_writer_reflects_greedily_within_its_budget(tokenizer):
    engine = _Echo(tokenizer, "  I walked into the wall.\nNext time go north. ")
    w = ReflectionWriter(engine, tokenizer, max_tokens=40)
    assert w.reflect([_record(1), _record(3)]) == ["I walked into the wall. Next time go north."] * 2
    assert engine.params.temperature == 0.0 and engine.params.max_new_tokens == 40
    assert w.reflect([]) == []
    # a reply repeating the instruction (the 135M actor's usual greedy reply) is no reflection
    from crl_bench.experience.reflections import REFLECTION_SYSTEM_PROMPT

    engine.reply = REFLECTION_SYSTEM_PROMPT.replace("\n", " ")
    assert w.reflect([_record(1)]) == [""]


class _Recording(_Echo):
    """An engine that answers a fixed reflection and keeps the prompts it was given."""

    def __init__(self, tokenizer, reply):
        super().__init__(tokenizer, reply)
        self.prompts = []

    def generate(self, prompts, params, allowed=None):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        return super().generate(prompts, params, allowed)


class _Reflections:
    """The manager's reflection store (``reflections``, ``add_reflections``), in memory."""

    def __init__(self):
        self.rows = []

    def reflections(self, env_id, task, limit=3):
        return [x for e, t, x, _ in self.rows if (e, t) == (env_id, task)][-limit:]

    def add_reflections(self, rows):
        self.rows += rows


def test_the_reflector_is_shown_the_tasks_last_reflections(tokenizer):
    # released Reflexion (alfworld_runs/generate_reflections.py): the reflection query of a failed
    # attempt ends with the task's last 3 reflections ("Plans from past attempts")
    from crl_bench.config import build_config, preset_data
    from crl_bench.experience.reflections import EARLIER_HEADER, ReflectionsMemory
    from crl_bench.rollout import Trajectory, Turn

    cfg = build_config([preset_data("smoke"), {"method": "reflexion", "rollout": {"mix": "sokoban"}}])
    engine = _Recording(tokenizer, "Push the box up first.")
    memory = ReflectionsMemory(cfg, engine, tokenizer)
    store = _Reflections()
    store.add_reflections([("room", 1, f"plan {n}", n) for n in range(1, 5)] + [("room", 2, "other task", 1)])

    def failed(task):
        turn = Turn([], [], [], "west", False, 0.0, observation="A wall.", reply="west")
        return Trajectory("room", task, 0, "guided", turns=[turn], task_prompt="Reach the stairs.",
                          meta={}, final_obs="A wall.")

    assert memory.write(store, [failed(1), failed(3)], step=5) == 2
    own, fresh = engine.prompts
    assert EARLIER_HEADER in own and "Attempt 1: plan 2\nAttempt 2: plan 3\nAttempt 3: plan 4" in own
    assert "plan 1" not in own and "other task" not in own
    assert EARLIER_HEADER not in fresh                       # a task's first failure has nothing before it
    assert store.reflections("room", 1, 1) == ["Push the box up first."]
