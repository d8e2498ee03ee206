"""Tests of the Sokoban text environment (envs/sokoban.py): generator, dynamics, parsing, protocol."""

from __future__ import annotations

from collections import deque

import gymnasium
import pytest

from crl_bench import env_api
from crl_bench.envs import sokoban
from crl_bench.envs.sokoban import MOVES, SokobanEnv, SokobanState, generate_level, level_identity, train_level

N_LEVELS = 200
SOLVE_BOUND = 200_000  # BFS states explored before giving up


def solve(level: SokobanState, max_states: int = SOLVE_BOUND) -> list[str] | None:
    """The library's solver (envs/sokoban.py) with this file's state bound."""
    return sokoban.solve(level, max_states)


def _blocked_directions(level: SokobanState) -> tuple[list[str], list[str]]:
    """Directions in which the player walks into a wall, and in which it pushes a blocked box."""
    walls, boxes = set(level.walls), set(level.boxes)
    into_wall, blocked_box = [], []
    for action, (dr, dc) in MOVES.items():
        nxt = (level.player[0] + dr, level.player[1] + dc)
        behind = (nxt[0] + dr, nxt[1] + dc)
        if nxt in walls:
            into_wall.append(action)
        elif nxt in boxes and (behind in walls or behind in boxes):
            blocked_box.append(action)
    return into_wall, blocked_box


@pytest.fixture
def env() -> SokobanEnv:
    return SokobanEnv()


def test_deterministic_per_task():
    assert generate_level(0) == generate_level(0)
    assert generate_level(123_456) == generate_level(123_456)
    e1, e2 = SokobanEnv(), SokobanEnv()
    o1, _ = e1.reset(options={"task": 7})
    e1.step("<answer>up</answer>")
    o2, _ = e2.reset(options={"task": 7})
    assert o1 == o2 and e1.reset(options={"task": 7})[0] == o2
    # seed doubles as the task id
    assert e1.reset(seed=7)[0] == o2
    levels = {generate_level(t) for t in range(50)}
    assert len(levels) >= 45  # different ids give (almost always) different levels


def test_levels_well_formed():
    for task in range(N_LEVELS):
        lv = generate_level(task)
        assert (lv.height, lv.width) == (6, 6)
        assert len(lv.boxes) == len(lv.targets) == 2
        assert len(set(lv.boxes)) == 2 and len(set(lv.targets)) == 2
        walls = set(lv.walls)
        border = {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}
        assert border <= walls
        assert lv.player not in walls and lv.player not in lv.boxes
        assert not walls & set(lv.boxes) and not walls & set(lv.targets)
        # the generator never starts with a box on a target
        assert not set(lv.boxes) & set(lv.targets), task


def test_generation_work_is_small(monkeypatch):
    """Generating a level draws a few rooms and its reverse play visits a few hundred states at most:
    the work is counted, not timed (the same count on every machine, the levels being seeded)."""
    rooms, states = [0], [0]
    carve = sokoban._carve_room

    def counting_carve(*args):
        rooms[0] += 1
        return carve(*args)

    class CountingDeque(deque):                # the reverse play's frontier: one append per new state
        def append(self, item):
            states[0] += 1
            super().append(item)

    monkeypatch.setattr(sokoban, "_carve_room", counting_carve)
    monkeypatch.setattr(sokoban, "deque", CountingDeque)
    for task in range(1_000_000, 1_000_200):
        generate_level(task)
    # 778 rooms and 14,498 states for these 200 levels when written: bounds of 10 rooms and 200 states
    # per level on average
    assert 200 <= rooms[0] <= 10 * 200 and 0 < states[0] <= 200 * 200, (rooms, states)


def _content(level: SokobanState) -> tuple:
    """Walls, targets and boxes of a level (the player start left out), computed here independently."""
    return (tuple(sorted(level.walls)), tuple(sorted(level.targets)), tuple(sorted(level.boxes)))


N_TRAIN_CHECKED = 3000  # ~0.3 ms a level


def test_train_ids_never_give_an_eval_level():
    env = SokobanEnv()
    eval_keys = set()
    for task in env.task_ids("eval"):
        env.reset(options={"task": task})
        # eval levels are the raw generator's, unchanged
        assert env.state() == generate_level(task)
        eval_keys.add(_content(env.state()))
    raw_hits = [t for t in range(N_TRAIN_CHECKED) if _content(generate_level(t)) in eval_keys]
    # the raw generator does repeat eval levels in this range (~10% of ids), so the check below bites
    assert len(raw_hits) > 50
    for task in range(N_TRAIN_CHECKED):
        assert _content(train_level(task)) not in eval_keys, task
    for task in raw_hits[:20]:
        env.reset(options={"task": task})
        assert _content(env.state()) not in eval_keys
        assert env.state() != generate_level(task)
    # a train id whose raw level is no eval level keeps it
    clean = next(t for t in range(N_TRAIN_CHECKED) if t not in set(raw_hits))
    assert train_level(clean) == generate_level(clean)


def test_level_identity_ignores_the_player_start():
    lv = generate_level(0)
    moved = lv._replace(player=next(c for c in ((r, k) for r in range(6) for k in range(6))
                                    if c not in lv.walls and c not in lv.boxes and c != lv.player))
    assert level_identity(moved) == level_identity(lv)
    assert level_identity(lv._replace(boxes=lv.targets)) != level_identity(lv)


def test_redrawn_train_levels_are_deterministic():
    eval_ids = sokoban.eval_level_identities()
    hits = [t for t in range(500) if level_identity(generate_level(t)) in eval_ids][:5]
    assert hits
    first = [train_level(t) for t in hits]
    sokoban._eval_identities.cache_clear()  # recomputed from scratch: same levels
    assert [train_level(t) for t in hits] == first
    e1, e2 = SokobanEnv(), SokobanEnv()
    assert e1.reset(options={"task": hits[0]})[0] == e2.reset(options={"task": hits[0]})[0]
    assert e1.state() == first[0]
    # redraw seeds are independent of plain integer seeds
    assert generate_level(hits[0], attempt=1) != generate_level(hits[0])
    with pytest.raises(ValueError):
        generate_level(0, attempt=-1)


def test_generator_arguments():
    lv = generate_level(3, dim_room=(7, 8), num_boxes=3)
    assert (lv.height, lv.width) == (7, 8) and len(lv.boxes) == 3
    assert solve(lv) is not None
    with pytest.raises(ValueError):
        generate_level(0, dim_room=(3, 6))
    with pytest.raises(ValueError):
        generate_level(-1)
    with pytest.raises(RuntimeError):
        generate_level(0, num_boxes=20, max_tries=5)  # 20 boxes cannot fit a 4x4 interior


def test_observation_has_grid_and_legend(env):
    obs, info = env.reset(options={"task": 0})
    lv = env.state()
    lines = obs.splitlines()
    grid = [ln for ln in lines if len(ln) == 6 and set(ln) <= set("#_OX*P+")]
    assert len(grid) == 6 and grid[0] == "######" and grid[-1] == "######"
    for r, row in enumerate(grid):
        for c, ch in enumerate(row):
            if (r, c) in lv.walls:
                assert ch == "#"
            elif (r, c) == lv.player:
                assert ch in "P+"
            elif (r, c) in lv.boxes:
                assert ch in "X*"
    assert "Legend:" in obs and "# wall" in obs and "X box" in obs and "O target" in obs
    assert "* box on target" not in obs  # legend lists only the symbols present
    assert f"row {lv.player[0]}, column {lv.player[1]}" in obs
    assert "Boxes on targets: 0/2" in obs
    assert "Valid actions: up, down, left, right" in obs
    assert info["admissible_actions"] == ["up", "down", "left", "right"]
    assert info["success"] is False and info["steps"] == 0
    assert env.render() == obs
    assert env.task_prompt() == "Push both boxes onto the targets."
    assert "<answer>" in SokobanEnv.system_prompt


def test_every_level_solvable_by_replay(env):
    lengths = []
    for task in range(N_LEVELS):
        env.reset(options={"task": task})
        plan = solve(env.state())
        assert plan, f"task {task}: no solution found"
        assert len(plan) <= min(env.search_depth, env.max_steps), \
            f"task {task}: optimal solution has {len(plan)} moves"
        lengths.append(len(plan))
        for i, action in enumerate(plan):
            obs, reward, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
            last = i == len(plan) - 1
            assert terminated is last and truncated is False
            assert reward == (1.0 if last else 0.0)
            assert info["success"] is last and info["invalid_action"] is False
        assert "Boxes on targets: 2/2" in obs and "You win" in obs
        assert set(env.state().boxes) == set(env.state().targets)
    assert max(lengths) >= 8  # not only trivial levels


def test_push_into_wall_does_nothing(env):
    for task in range(N_LEVELS):
        env.reset(options={"task": task})
        into_wall, _ = _blocked_directions(env.state())
        if into_wall:
            break
    else:
        pytest.fail("no level starts with the player next to a wall")
    before = env.state()
    obs, reward, terminated, truncated, info = env.step(f"<answer>{into_wall[0]}</answer>")
    assert env.state() == before
    assert "bumped into a wall" in obs
    assert reward == 0.0 and not terminated and not truncated
    assert info["invalid_action"] is False and info["steps"] == 1


def test_blocked_box_does_not_move(env):
    for task in range(2000):
        env.reset(options={"task": task})
        _, blocked = _blocked_directions(env.state())
        if blocked:
            break
    else:
        pytest.fail("no level starts with a blocked push")
    before = env.state()
    obs, reward, *_ = env.step(f"<answer>{blocked[0]}</answer>")
    assert env.state() == before
    assert "box cannot move" in obs and reward == 0.0


def test_push_moves_box(env):
    env.reset(options={"task": 0})
    plan = solve(env.state())
    walls_before = env.state().walls
    pushes = 0
    for action in plan:
        before = env.state()
        obs, *_ = env.step(f"<answer>{action}</answer>")
        after = env.state()
        dr, dc = MOVES[action]
        moved = set(before.boxes) - set(after.boxes)
        if moved:
            (old,) = moved
            assert old == after.player
            assert (old[0] + dr, old[1] + dc) in after.boxes
            assert "pushed a box" in obs
            pushes += 1
        else:
            assert "You moved" in obs
        assert after.player == (before.player[0] + dr, before.player[1] + dc)
        assert after.walls == walls_before
    assert pushes >= 2


@pytest.mark.parametrize("reply", ["jump", "", "<answer>fly</answer>", "<answer></answer>",
                                   "<think>left</think>"])
def test_invalid_replies(env, reply):
    env.reset(options={"task": 1})
    before = env.state()
    obs, reward, terminated, truncated, info = env.step(reply)
    assert info["invalid_action"] is True and info["invalid_actions"] == 1
    assert reward == 0.0 and not terminated and not truncated
    assert "Invalid action" in obs
    assert env.state() == before
    assert info["steps"] == 1


@pytest.mark.parametrize("reply,action", [
    ("<ANSWER>  Left </answer>", "left"),
    ("<think>go right</think>\n<answer>RIGHT</answer>", "right"),
    ("<answer>u</answer>", "up"),
    ("<answer> South </answer>", "down"),
    ("<answer>Move  Left</answer>", "left"),
])
def test_case_whitespace_and_aliases(env, reply, action):
    env.reset(options={"task": 2})
    _, _, _, _, info = env.step(reply)
    assert info["invalid_action"] is False and info["action"] == action


def test_bare_action_needs_tags(env):
    env.reset(options={"task": 2})
    obs, _, _, _, info = env.step("up")
    assert info["invalid_action"] is True and "<answer>" in obs


def test_truncation_at_max_steps():
    env = SokobanEnv(max_steps=3)
    env.reset(options={"task": 0})
    for i in range(3):
        _, reward, terminated, truncated, info = env.step("<answer>fly</answer>" if i else "nope")
        assert reward == 0.0 and not terminated
        assert truncated is (i == 2)
    assert info["steps"] == 3
    with pytest.raises(RuntimeError):
        env.step("<answer>up</answer>")


def test_step_after_success_raises(env):
    env.reset(options={"task": 5})
    for action in solve(env.state()):
        _, reward, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
    assert terminated and not truncated and reward == 1.0 and info["success"]
    with pytest.raises(RuntimeError):
        env.step("<answer>up</answer>")
    with pytest.raises(RuntimeError):
        SokobanEnv().state()  # before reset


def test_splits(env):
    assert env.task_ids("train") == range(0, 1_000_000)
    assert env.task_ids("eval") == range(1_000_000, 1_000_500)
    with pytest.raises(KeyError):
        env.task_ids("test")


def test_make_env_registry():
    assert "sokoban" in env_api.list_envs()
    env = env_api.make_env("sokoban", max_steps=5)
    assert isinstance(env, SokobanEnv) and env.max_steps == 5
    obs, _ = env.reset(options={"task": 11})
    assert obs == SokobanEnv().reset(options={"task": 11})[0]
    with pytest.raises(TypeError):
        env_api.make_env("sokoban", no_such_setting=1)


def test_gymnasium_make():
    env_api.register_gymnasium()
    env = gymnasium.make("crl_bench/sokoban", max_steps=4)
    obs, info = env.reset(options={"task": 3})
    assert "Legend:" in obs and info["task"] == 3
    obs, reward, terminated, truncated, info = env.step("<answer>left</answer>")
    assert isinstance(obs, str) and info["steps"] == 1
    assert isinstance(env.unwrapped, SokobanEnv)
