"""The diagnostic envs of the experience mechanism (envs/diag.py): tables, splits, episodes, chance rates."""

from __future__ import annotations

import math
import re

import gymnasium
import numpy as np
import pytest

from crl_bench import env_api
from crl_bench.env_api import TextEnv, feedback_of, make_env
from crl_bench.envs.diag import (
    CONTEXT_NAMES,
    CORRIDOR_ACTIONS,
    DIAG_SPLITS,
    EVAL_VARIANTS,
    N_CONTEXTS,
    SEEN_CONTEXTS,
    UNSEEN_CONTEXTS,
    VAULT_ACTIONS,
    VAULT_CODES,
    ContextTasks,
    DiagCorridorEnv,
    DiagVaultEnv,
    corridor_sequences,
    surface_text,
)

ALL_ACTIONS = set(VAULT_ACTIONS) | set(CORRIDOR_ACTIONS)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _without_valid_line(obs: str) -> str:
    return "\n".join(ln for ln in obs.splitlines() if not ln.startswith("Valid actions:"))


def _play(env: TextEnv, task: int, actions: list[str]):
    """Reset to ``task`` and play ``actions`` until the episode ends; the last step's results."""
    obs, info = env.reset(options={"task": task})
    reward, terminated, truncated = 0.0, False, False
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(f"<answer>{a}</answer>")
        if terminated or truncated:
            break
    return obs, reward, terminated, truncated, info


@pytest.fixture(params=[DiagVaultEnv, DiagCorridorEnv], ids=["vault", "corridor"])
def env(request):
    return request.param()


# ---- tables --------------------------------------------------------------------------------------------
def test_vault_codes_are_pinned_and_balanced():
    assert VAULT_ACTIONS == ("anchor", "bell", "crown", "feather", "key", "lamp", "moon", "star")
    assert VAULT_CODES == ("key", "anchor", "moon", "crown", "star", "lamp", "bell", "feather",
                           "crown", "lamp", "anchor", "star", "feather", "bell", "key", "moon")
    # each action is the code of exactly one seen and exactly one unseen context
    assert sorted(VAULT_CODES[:8]) == sorted(VAULT_ACTIONS)
    assert sorted(VAULT_CODES[8:]) == sorted(VAULT_ACTIONS)
    assert all(VAULT_CODES[c] != VAULT_CODES[c + 8] for c in range(8))


def test_vault_any_constant_policy_gets_exactly_one_eighth_of_each_eval_split():
    env = DiagVaultEnv()
    for split in ("eval", "eval_unseen"):
        tasks = list(env.task_ids(split))
        for action in VAULT_ACTIONS:
            wins = sum(_play(env, t, [action])[4]["success"] for t in tasks)
            assert wins * 8 == len(tasks) == 64, (split, action, wins)


def test_corridor_default_table_is_pinned():
    assert corridor_sequences(3, 3) == (
        ("left", "middle", "middle"), ("middle", "left", "right"), ("middle", "left", "middle"),
        ("right", "middle", "left"), ("left", "right", "middle"), ("right", "right", "left"),
        ("middle", "left", "left"), ("left", "middle", "right"),
        ("right", "middle", "middle"), ("right", "left", "middle"), ("left", "left", "middle"),
        ("left", "right", "left"), ("left", "left", "right"), ("middle", "middle", "right"),
        ("middle", "middle", "left"), ("middle", "right", "left"),
    )
    env = DiagCorridorEnv()
    solutions = [env.solution(10_000 * N_CONTEXTS + c) for c in range(N_CONTEXTS)]
    assert solutions == [list(s) for s in corridor_sequences(3, 3)]


@pytest.mark.parametrize("length,choices", [(3, 3), (2, 2), (4, 2), (2, 5), (3, 6), (5, 4)])
def test_corridor_balanced_per_door_over_seen_and_over_unseen_contexts(length, choices):
    table = corridor_sequences(length, choices)
    assert len(table) == N_CONTEXTS and all(len(s) == length for s in table)
    low, high = 8 // choices, -(-8 // choices)
    for group in (SEEN_CONTEXTS, UNSEEN_CONTEXTS):
        for k in range(length):
            counts = [sum(table[c][k] == a for c in group) for a in CORRIDOR_ACTIONS[:choices]]
            assert sum(counts) == 8 and all(low <= n <= high for n in counts), (group, k, counts)


@pytest.mark.parametrize("length,choices", [(3, 3), (4, 3), (2, 6), (3, 4)])
def test_corridor_sequences_distinct_and_never_constant_where_possible(length, choices):
    table = corridor_sequences(length, choices)
    assert len(set(table)) == N_CONTEXTS
    assert all(len(set(seq)) > 1 for seq in table)


def test_corridor_constant_policy_never_succeeds():
    env = DiagCorridorEnv()
    for split in ("eval", "eval_unseen"):
        for action in env.admissible_actions():
            assert not any(_play(env, t, [action] * 3)[4]["success"] for t in env.task_ids(split))


def test_tables_are_cached_and_validated():
    assert corridor_sequences(3, 3) is corridor_sequences(3, 3)
    for length, choices in ((0, 3), (3, 0), (3, len(CORRIDOR_ACTIONS) + 1)):
        with pytest.raises(ValueError):
            corridor_sequences(length, choices)


# ---- splits ----------------------------------------------------------------------------------------------
def test_splits_sizes_contexts_and_no_overlap():
    env = DiagVaultEnv()
    train, ev, unseen = (env.task_ids(s) for s in ("train", "eval", "eval_unseen"))
    assert set(env.splits) == {"train", "eval", "eval_unseen"}
    assert DiagCorridorEnv().splits is DIAG_SPLITS and env.splits is DIAG_SPLITS
    assert (len(train), len(ev), len(unseen)) == (80_000, 64, 64)
    train_set, ev_set, unseen_set = set(train), set(ev), set(unseen)
    assert len(train_set) == 80_000 and len(ev_set) == len(unseen_set) == 64
    assert not (train_set & ev_set) and not (train_set & unseen_set) and not (ev_set & unseen_set)
    ctx = env.context_index
    assert {ctx(t) for t in train_set} == {ctx(t) for t in ev_set} == set(SEEN_CONTEXTS)
    assert {ctx(t) for t in unseen_set} == set(UNSEEN_CONTEXTS)
    assert {ctx(t) for t in unseen_set}.isdisjoint({ctx(t) for t in train_set})
    # eval splits: 8 new variants of each of their contexts
    assert {t // N_CONTEXTS for t in ev_set | unseen_set} == set(EVAL_VARIANTS)
    assert max(train_set) // N_CONTEXTS < min(EVAL_VARIANTS)


def test_context_tasks_is_a_fast_exact_sequence():
    seq = ContextTasks(range(3, 7), range(8, 11))
    as_list = [v * 16 + c for v in range(3, 7) for c in range(8, 11)]
    assert list(seq) == as_list and len(seq) == len(as_list)
    assert [seq[i] for i in range(-len(seq), len(seq))] == as_list + as_list
    assert seq[2:7] == as_list[2:7] and seq[::-1] == as_list[::-1]
    for t in range(-20, 8 * 16):
        assert (t in seq) == (t in as_list), t
    assert np.int64(as_list[0]) in seq and True not in seq and "56" not in seq and 56.5 not in seq
    with pytest.raises(IndexError):
        seq[len(seq)]
    with pytest.raises(ValueError):
        ContextTasks(range(0, 2), range(15, 17))
    # the trainer's sampler: len and integer indexing of the train split
    train = DIAG_SPLITS["train"]
    rng = np.random.default_rng(0)
    assert all(int(train[int(i)]) in train for i in rng.integers(len(train), size=100))


def test_check_task_and_unknown_ids(env):
    assert env.check_task(5) == 5 and env.check_task(10_000 * 16 + 8) == 10_000 * 16 + 8
    for bad in (-1, 5 * 16 + 8, 10_008 * 16, 10_000 * 16 + 16 * 8, 16 * 10_000 - 8):
        with pytest.raises(KeyError):
            env.check_task(bad)
        with pytest.raises(KeyError):
            env.context(bad)
        with pytest.raises(KeyError):
            env.reset(options={"task": bad})
    obs, info = env.reset(seed=16 * 7 + 3)        # no task: the seed is the task id
    assert info["task"] == 16 * 7 + 3
    env.reset()                                   # no task, no seed: a draw from the train split
    assert env.task in env.task_ids("train")


# ---- observations and contexts ---------------------------------------------------------------------------
def test_contexts_names_and_types(env):
    assert len(CONTEXT_NAMES) == len(set(CONTEXT_NAMES)) == N_CONTEXTS
    for t in list(env.task_ids("eval")) + list(env.task_ids("eval_unseen")) + [0, 7, 16 * 9999 + 7]:
        c = t % N_CONTEXTS
        assert env.context_index(t) == c and env.context(t) == CONTEXT_NAMES[c] == env.task_type(t)


def test_no_context_name_or_surface_text_holds_an_action_name():
    for name in CONTEXT_NAMES:
        assert not any(a in name.lower() for a in ALL_ACTIONS), name
    for variant in range(42):
        assert not (_words(surface_text(variant)) & ALL_ACTIONS), surface_text(variant)
    assert len({surface_text(v) for v in range(10_000, 10_042)}) == 42


def test_every_task_of_a_context_has_one_solution_and_its_own_observation(env):
    for c in range(N_CONTEXTS):
        split = "eval" if c in SEEN_CONTEXTS else "eval_unseen"
        tasks = [t for t in env.task_ids(split) if t % N_CONTEXTS == c]
        tasks += [v * N_CONTEXTS + c for v in (0, 1, 41, 9999)] if c in SEEN_CONTEXTS else []
        assert len({tuple(env.solution(t)) for t in tasks}) == 1
        observations = []
        for t in tasks:
            obs, _ = env.reset(options={"task": t})
            name = f"the {CONTEXT_NAMES[c]}"
            assert name in obs.splitlines()[0] and name in env.task_prompt()
            assert obs.splitlines()[-1] == "Valid actions: " + ", ".join(env.admissible_actions())
            observations.append(obs)
        assert len(set(observations)) == len(observations)


def test_observation_does_not_depend_on_the_solution(env):
    """Tasks of one variant differ only in the context name: nothing else in the text tells contexts
    (and so solutions) apart."""
    obs = [env.reset(options={"task": 10_000 * N_CONTEXTS + c})[0] for c in range(N_CONTEXTS)]
    masked = {o.replace(CONTEXT_NAMES[c], "X") for c, o in enumerate(obs)}
    assert len(masked) == 1


def test_reset_is_deterministic_per_task_and_info_has_the_common_keys(env):
    fresh = type(env)()
    for t in (0, 16 * 4321 + 5, 10_000 * N_CONTEXTS + 12):
        a, info = env.reset(options={"task": t})
        b, _ = fresh.reset(options={"task": t})
        assert a == b and env.render() == a
        assert info["task"] == t and info["steps"] == 0 and info["success"] is False
        assert info["invalid_action"] is False and info["admissible_actions"] == env.admissible_actions()


def test_vault_observation_states_the_dial():
    env = DiagVaultEnv()
    obs, info = env.reset(options={"task": 10_000 * N_CONTEXTS + 3})
    assert obs.splitlines()[0] == "Open the vault of the Tessaly Chapel."
    assert "8 positions" in obs and info["admissible_actions"] == list(VAULT_ACTIONS)
    assert env.task_prompt() == "Open the vault of the Tessaly Chapel."
    assert DiagVaultEnv().task_prompt() == ""


# ---- episodes --------------------------------------------------------------------------------------------
def test_playing_the_solution_succeeds(env):
    for t in list(env.task_ids("eval")) + list(env.task_ids("eval_unseen")) + [16 * 777 + 2]:
        env.reset(options={"task": t})
        solution = env.solution(t)
        for k, a in enumerate(solution):
            obs, reward, terminated, truncated, info = env.step(f"<answer>{a}</answer>")
            last = k == len(solution) - 1
            assert terminated == last and not truncated and info["success"] == last
            assert reward == (1.0 if last else 0.0)
            if not last:
                assert f"door {k + 2} of {len(solution)}" in obs
        with pytest.raises(RuntimeError):
            env.step(f"<answer>{solution[0]}</answer>")


def test_vault_wrong_action_fails_without_revealing_the_code():
    env = DiagVaultEnv()
    for t in list(env.task_ids("eval")) + list(env.task_ids("eval_unseen")):
        code = env.solution(t)[0]
        for wrong in VAULT_ACTIONS:
            if wrong == code:
                continue
            obs, reward, terminated, truncated, info = _play(env, t, [wrong])
            assert terminated and not truncated and reward == 0.0 and not info["success"]
            assert code not in _words(_without_valid_line(obs)) and code not in feedback_of(obs)
            assert wrong in feedback_of(obs)


def test_corridor_wrong_passage_at_any_door_fails_without_revealing_it():
    env = DiagCorridorEnv()
    for t in list(env.task_ids("eval"))[:16] + list(env.task_ids("eval_unseen"))[:16]:
        solution = env.solution(t)
        for k, right in enumerate(solution):
            for wrong in env.admissible_actions():
                if wrong == right:
                    continue
                obs, reward, terminated, truncated, info = _play(env, t, solution[:k] + [wrong])
                assert terminated and not truncated and reward == 0.0 and not info["success"]
                assert info["steps"] == k + 1
                assert right not in _words(_without_valid_line(obs)) and right not in feedback_of(obs)
                assert f"door {k + 1} of 3" in obs


def test_corridor_shows_the_door():
    env = DiagCorridorEnv(length=4, choices=2)
    t = 10_000 * N_CONTEXTS + 9
    obs, _ = env.reset(options={"task": t})
    assert obs.splitlines()[0] == "Find the way through the doors of the Arbeth Treasury."
    assert "You are at door 1 of 4." in obs and obs.splitlines()[-1] == "Valid actions: left, middle"
    obs, *_ = env.step(f"<answer>{env.solution(t)[0]}</answer>")
    assert "You are at door 2 of 4." in obs


def test_invalid_replies_are_invalid_actions_not_crashes(env):
    env.reset(options={"task": 10_000 * N_CONTEXTS})
    for k, reply in enumerate(["no tags at all", "<answer>teal</answer>"]):
        obs, reward, terminated, truncated, info = env.step(reply)
        assert info["invalid_action"] and not terminated and reward == 0.0 and info["steps"] == k + 1
        assert feedback_of(obs).startswith("Invalid action")
    env = DiagVaultEnv(max_steps=2) if isinstance(env, DiagVaultEnv) else DiagCorridorEnv(length=2, max_steps=2)
    env.reset(options={"task": 3})
    wrong_set = "<answer>left</answer>" if isinstance(env, DiagVaultEnv) else "<answer>anchor</answer>"
    env.step(wrong_set)                             # the other env's action is not valid here
    _, _, terminated, truncated, info = env.step("<answer></answer>")
    assert truncated and not terminated and info["invalid_actions"] == 2 and not info["success"]


def test_default_settings_and_validation():
    assert DiagVaultEnv().max_steps == 3
    corridor = DiagCorridorEnv()
    assert (corridor.length, corridor.choices, corridor.max_steps) == (3, 3, 5)
    assert corridor.admissible_actions() == ["left", "middle", "right"]
    assert DiagCorridorEnv(length=5).max_steps == 7 and DiagCorridorEnv(max_steps=3).max_steps == 3
    for kwargs in ({"length": 1}, {"choices": 1}, {"choices": len(CORRIDOR_ACTIONS) + 1},
                   {"length": 4, "max_steps": 3}):
        with pytest.raises(ValueError):
            DiagCorridorEnv(**kwargs)


# ---- chance rates ----------------------------------------------------------------------------------------
def test_chance_rates_are_exact():
    assert DiagVaultEnv().chance_success_rate() == 1 / 8
    assert DiagCorridorEnv().chance_success_rate() == pytest.approx(1 / 27, rel=1e-15)
    assert DiagCorridorEnv(length=2, choices=4).chance_success_rate() == pytest.approx(1 / 16, rel=1e-15)


@pytest.mark.parametrize("make", [DiagVaultEnv, DiagCorridorEnv, lambda: DiagCorridorEnv(length=2, choices=4)],
                         ids=["vault", "corridor", "corridor-2x4"])
def test_uniform_random_policy_matches_the_chance_rate(make):
    env = make()
    rng = np.random.default_rng(0)
    train = env.task_ids("train")
    n, wins = 4000, 0
    for _ in range(n):
        env.reset(options={"task": int(train[int(rng.integers(len(train)))])})
        terminated = truncated = False
        while not (terminated or truncated):
            legal = env.admissible_actions()
            _, _, terminated, truncated, info = env.step(f"<answer>{legal[int(rng.integers(len(legal)))]}</answer>")
        assert not truncated
        wins += info["success"]
    p = env.chance_success_rate()
    assert abs(wins / n - p) <= 4 * math.sqrt(p * (1 - p) / n), (wins / n, p)


# ---- lessons ---------------------------------------------------------------------------------------------
def test_lesson_names_exactly_the_actions_and_the_context(env):
    actions = env.admissible_actions()
    for t in (0, 10_000 * N_CONTEXTS + 11):
        name = env.context(t)
        for given in ([actions[1]], env.solution(t), [actions[0], actions[-1]]):
            lesson = env.lesson_for(t, given)
            assert lesson.startswith(f"In the {name}, ") and lesson.endswith(".")
            assert _words(lesson) & ALL_ACTIONS == set(given)
            found = [w for w in re.findall(r"[a-z]+", lesson) if w in ALL_ACTIONS]
            assert found == list(given)
    with pytest.raises(ValueError):
        env.lesson_for(0, [])
    with pytest.raises(ValueError):
        env.lesson_for(0, ["teal"])
    with pytest.raises(KeyError):
        env.lesson_for(-1, [actions[0]])


def test_lesson_wording():
    assert DiagVaultEnv().lesson_for(0, ["key"]) == "In the Corvane Archive, turn the dial to the key."
    assert DiagCorridorEnv().lesson_for(1, ["middle", "left", "right"]) == \
        "In the Haldel Observatory, take middle, then left, then right."


# ---- registry and base defaults --------------------------------------------------------------------------
def test_registry_and_gymnasium():
    assert {"diag-vault", "diag-corridor"} <= set(env_api.list_envs())
    vault = make_env("diag-vault", max_steps=4)
    assert isinstance(vault, DiagVaultEnv) and vault.max_steps == 4
    corridor = make_env("diag-corridor", length=2, choices=4)
    assert isinstance(corridor, DiagCorridorEnv) and corridor.chance_success_rate() == 1 / 16
    env_api.register_gymnasium()
    for env_id in ("diag-vault", "diag-corridor"):
        env = gymnasium.make(f"crl_bench/{env_id}")
        obs, info = env.reset(options={"task": 10_000 * N_CONTEXTS + 2})
        assert "the Mirrow Library" in obs and info["task"] == 10_000 * N_CONTEXTS + 2
        _, reward, terminated, _, info = env.step(f"<answer>{env.unwrapped.solution(info['task'])[0]}</answer>")
        assert reward == (1.0 if env_id == "diag-vault" else 0.0) and terminated == (env_id == "diag-vault")


class _NoContexts(TextEnv):
    def _reset_task(self, task):
        pass

    def _apply(self, action):
        return 0.0, True, False, ""

    def _observe(self, message=""):
        return message


def test_text_env_defaults_have_no_context_and_no_chance_rate():
    env = _NoContexts()
    assert env.context(0) is None and env.chance_success_rate() is None


def test_envs_list_prints_known_chance_rates(monkeypatch, capsys):
    from crl_bench.cli import main

    monkeypatch.setattr(env_api, "list_envs", lambda: ["diag-corridor", "diag-vault", "sokoban"])
    assert main(["envs", "list"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert lines["diag-vault"].endswith("chance success: 0.125")
    assert "eval_unseen: 64" in lines["diag-vault"]
    assert lines["diag-corridor"].endswith("chance success: 0.03704")
    assert "chance" not in lines["sokoban"]


def test_grade_lesson_reads_contexts_and_solutions():
    from crl_bench.envs.diag import CONTEXT_NAMES, VAULT_CODES, DiagCorridorEnv, DiagVaultEnv

    vault = DiagVaultEnv()
    name, code = CONTEXT_NAMES[0], VAULT_CODES[0]
    other = next(a for a in vault.admissible_actions() if a != code)
    assert vault.grade_lesson(vault.lesson_for(0, [code])) == {"contexts": [name], "actions": [code], "correct": True}
    assert vault.grade_lesson(vault.lesson_for(0, [other]))["correct"] is False
    assert vault.grade_lesson(f"Always pick {code}.")["correct"] is False          # no context named
    elsewhere = f"In the {CONTEXT_NAMES[1]}, turn the dial to the {code}."
    assert vault.grade_lesson(elsewhere)["correct"] is (VAULT_CODES[1] == code)
    assert vault.grade_lesson(f"{name.upper()}: {code.upper()}!")["correct"] is True
    assert vault.grade_lesson(f"In the {name}, the keys of the dial")["actions"] == []   # whole words only
    corridor = DiagCorridorEnv()
    sol = corridor.solution(0)
    assert corridor.grade_lesson(corridor.lesson_for(0, sol))["correct"] is True
    assert corridor.grade_lesson(corridor.lesson_for(0, list(reversed(sol))))["correct"] is (sol == sol[::-1])
    assert corridor.grade_lesson(corridor.lesson_for(0, sol[:-1]))["correct"] is False


def test_grade_lesson_for_a_given_context():
    from crl_bench.envs.diag import CONTEXT_NAMES, VAULT_CODES, DiagVaultEnv

    vault = DiagVaultEnv()
    text = f"In the {CONTEXT_NAMES[0]}, turn the dial to the {VAULT_CODES[1]}. In the {CONTEXT_NAMES[1]}, too."
    assert vault.grade_lesson(text)["correct"] is True                          # right for context 1
    assert vault.grade_lesson(text, context=CONTEXT_NAMES[1])["correct"] is True
    assert vault.grade_lesson(text, context=CONTEXT_NAMES[0])["correct"] is False
    assert vault.grade_lesson(text, context=CONTEXT_NAMES[2])["contexts"] == list(CONTEXT_NAMES[:2])


# ---- practice worlds (the extractor warm start's invented contexts) ---------------------------------------
def test_practice_worlds_invent_names_that_are_neither_real_nor_hold_an_action():
    from crl_bench.envs.diag import practice_contexts

    real_first = {n.split()[0] for n in CONTEXT_NAMES}
    seen = set()
    for world in range(300):
        names, codes, seqs = practice_contexts(world)
        assert len(set(names)) == N_CONTEXTS and len({n.split()[0] for n in names}) == N_CONTEXTS
        for name in names:
            assert name not in CONTEXT_NAMES and name.split()[0] not in real_first
            assert not any(a in name.lower() for a in ALL_ACTIONS), name
        # chance stays exact: each half's codes are a permutation of the dial
        assert sorted(codes[:8]) == sorted(VAULT_ACTIONS) and sorted(codes[8:]) == sorted(VAULT_ACTIONS)
        assert all(len(s) == 3 and set(s) <= set(CORRIDOR_ACTIONS[:3]) for s in seqs)
        seen.add(names)
    assert len(seen) == 300
    assert practice_contexts(5) == practice_contexts(5)
    with pytest.raises(ValueError):
        practice_contexts(-1)


@pytest.mark.parametrize("cls", [DiagVaultEnv, DiagCorridorEnv], ids=["vault", "corridor"])
def test_practice_env_plays_its_own_contexts_and_grades_its_own_lessons(cls):
    from crl_bench.envs.diag import practice_contexts

    real, practice = cls(), cls(practice_world=7)
    names = practice_contexts(7)[0]
    task = 3 * N_CONTEXTS + 2
    assert real.context(task) == CONTEXT_NAMES[2] and practice.context(task) == names[2]
    obs, _ = practice.reset(options={"task": task})
    assert names[2] in obs and CONTEXT_NAMES[2] not in obs and names[2] in practice.task_prompt()
    *_, info = _play(practice, task, practice.solution(task))
    assert info["success"]
    lesson = practice.lesson_for(task, practice.solution(task))
    assert practice.grade_lesson(lesson, names[2])["correct"]
    assert not real.grade_lesson(lesson)["correct"]        # a practice lesson says nothing of a real context
    # the real env is unchanged by the keyword's existence
    assert real.solution(task) == cls(practice_world=None).solution(task)
    assert practice.task_fingerprint(task) != real.task_fingerprint(task)
