"""Tests of the MiniHack text environments (CPU, real NLE, no model)."""

from __future__ import annotations

from collections import deque

import pytest

from crl_bench.env_api import make_env
from crl_bench.envs.minihack import (
    MOVE_DELTAS,
    MiniHackCorridorEnv,
    MiniHackKeyRoomEnv,
    MiniHackMaze15Env,
    MiniHackMazeEnv,
    MiniHackRiverEnv,
    MiniHackRoomEnv,
    MiniHackTextEnv,
)

ENV_CLASSES = [MiniHackRoomEnv, MiniHackMazeEnv, MiniHackMaze15Env, MiniHackCorridorEnv, MiniHackKeyRoomEnv,
               MiniHackRiverEnv]
MOVES = list(MOVE_DELTAS)


def ans(action: str) -> str:
    return f"<think>...</think><answer>{action}</answer>"


@pytest.fixture(scope="module")
def envs():
    made = {cls: cls() for cls in ENV_CLASSES}
    yield made
    for env in made.values():
        env.close()


# ---- a scripted player that reads the rendered map ---------------------------------------------

def parse_map(obs: str) -> list[str]:
    lines = obs.splitlines()
    i = lines.index("Map (row 0 is the top):")
    j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("Legend:"))
    rows = lines[i + 1:j]
    width = max(len(r) for r in rows)
    return [r.ljust(width) for r in rows]


def cells(grid: list[str], sym: str) -> list[tuple[int, int]]:
    return [(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == sym]


def at(grid: list[str], r: int, c: int) -> str:
    return grid[r][c] if 0 <= r < len(grid) and 0 <= c < len(grid[0]) else " "


def first_move(grid, start, is_goal, start_in_door=False):
    """First move of a shortest path (8-connected; no diagonal steps through doors)."""
    prev = {start: None}
    queue = deque([start])
    while queue:
        cur = queue.popleft()
        if cur != start and is_goal(cur):
            while prev[cur][0] != start:
                cur = prev[cur][0]
            return prev[cur][1]
        here_door = at(grid, *cur) == "'" or (cur == start and start_in_door)
        for name, (dr, dc) in MOVE_DELTAS.items():
            nxt = (cur[0] + dr, cur[1] + dc)
            if nxt in prev or at(grid, *nxt) not in ".><'(":
                continue
            if dr and dc and (here_door or at(grid, *nxt) == "'"):
                continue
            prev[nxt] = (cur, name)
            queue.append(nxt)
    return None


def near(a, b) -> bool:
    return max(abs(a[0] - b[0]), abs(a[1] - b[1])) == 1


def room_policy(obs: str) -> str:
    grid = parse_map(obs)
    return first_move(grid, cells(grid, "@")[0], lambda c: at(grid, *c) == ">")


def keyroom_policy(obs: str) -> str:
    grid = parse_map(obs)
    me = cells(grid, "@")[0]
    in_door = "(in a doorway" in obs

    def go(goal):
        return first_move(grid, me, goal, in_door)

    def frontier(c):
        return any(at(grid, c[0] + dr, c[1] + dc) == " " for dr, dc in MOVE_DELTAS.values())

    if "Key: carried." not in obs:
        if "You see here" in obs and "key" in obs.split("Last:")[-1]:
            return "pickup"
        return go(lambda c: at(grid, *c) == "(") if cells(grid, "(") else go(frontier)
    if cells(grid, ">"):
        move = go(lambda c: at(grid, *c) == ">")
        if move:
            return move
    doors = cells(grid, "+")
    if doors:
        if any(near(d, me) for d in doors):
            return "apply"
        return go(lambda c: any(near(d, c) for d in doors))
    return go(frontier)


def play(env, policy, task, limit):
    obs, info = env.reset(options={"task": task})
    trace = [obs]
    for _ in range(limit):
        obs, reward, terminated, truncated, info = env.step(ans(policy(obs) or "north"))
        trace.append(obs)
        if terminated or truncated:
            return obs, reward, terminated, truncated, info, trace
    raise AssertionError("episode did not end")


# ---- every env ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_reset_text(envs, cls):
    env = envs[cls]
    obs, info = env.reset(options={"task": 3})
    assert "Map (row 0 is the top):" in obs and "Legend: @ you" in obs
    assert "You are at row" in obs and "Valid actions: north" in obs
    assert "@" in "".join(parse_map(obs))
    assert "welcome to NetHack" not in obs
    assert info["success"] is False and info["steps"] == 0 and info["task"] == 3
    assert info["admissible_actions"] == env.admissible_actions()
    assert env.admissible_actions()[:8] == MOVES
    assert env.render() == obs
    assert env.task_prompt() and "'>'" in env.task_prompt()
    assert env.retrieval_query(obs) == "Observation: " + obs.strip()     # released MiniHack query
    assert "<answer>" in env.system_prompt and "northwest" in env.system_prompt
    assert list(env.task_ids("eval")) == list(range(1_000_000, 1_000_500))
    assert env.task_ids("train") == range(0, 1_000_000)


def test_action_sets():
    assert MiniHackKeyRoomEnv.system_prompt.count("pickup") == 1
    env = MiniHackKeyRoomEnv()
    try:
        assert env.admissible_actions() == MOVES + ["pickup", "apply"]
        assert env.parse_action(ans("pick up")).action == "pickup"
        assert env.parse_action(ans("Use key")).action == "apply"
    finally:
        env.close()


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_determinism(envs, cls):
    env = envs[cls]
    first, _ = env.reset(options={"task": 7})
    assert env.reset(seed=7)[0] == first
    for other in (8, 1_000_001):  # other episodes, with steps, in between
        env.reset(options={"task": other})
        for a in ("east", "south", "west"):
            env.step(ans(a))
    assert env.reset(options={"task": 7})[0] == first
    if cls is MiniHackRoomEnv:  # MiniHack-Room-5x5-v0 is one fixed room: compare a random variant
        env = MiniHackRoomEnv(variant="MiniHack-Room-Random-5x5-v0")
    try:
        maps = {env.reset(options={"task": t})[0] for t in range(6)}
        assert len(maps) > 1
    finally:
        if env is not envs[cls]:
            env.close()


def test_dynamics_deterministic():
    """Same task and actions -> same observations, monsters included (Room-Ultimate)."""
    env = MiniHackRoomEnv(variant="MiniHack-Room-Ultimate-5x5-v0", max_steps=12)
    try:
        actions = ["east", "south", "southeast", "east", "south", "west", "north", "east"]
        runs = []
        for _ in range(2):
            trace = [env.reset(options={"task": 11})[0]]
            for a in actions:
                obs, _, term, trunc, _ = env.step(ans(a))
                trace.append(obs)
                if term or trunc:
                    break
            runs.append(trace)
            env.reset(options={"task": 12})
        assert runs[0] == runs[1]
    finally:
        env.close()


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_invalid_replies(envs, cls):
    env = envs[cls]
    obs0, _ = env.reset(options={"task": 1})
    for reply in ("no tags at all", "<answer>fly</answer>", "<answer></answer>", "", "<answer>up",
                  "<answer>" + "x" * 500 + "</answer>"):
        obs, reward, term, trunc, info = env.step(reply)
        valid = reply == "<answer>up"  # an unclosed tag (generation cut off) still parses
        assert info["invalid_action"] is (not valid) and reward == 0.0 and not term and not trunc
        assert ("Invalid action" in obs) is (not valid)
        assert info["action"] == ("north" if valid else None)
    assert info["invalid_actions"] == 5 and info["steps"] == 6  # "<answer>up" parses as north
    assert parse_map(obs) and parse_map(obs0)


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_truncation(cls):
    env = cls(max_steps=4)
    try:
        env.reset(options={"task": 2})
        outs = [env.step(ans(a)) for a in ("west", "north", "<bad>", "west")]
        assert [o[3] for o in outs] == [False, False, False, True]
        assert not any(o[2] for o in outs)
        with pytest.raises(RuntimeError):
            env.step(ans("east"))
        obs, _ = env.reset(options={"task": 2})  # reusable after the end
        assert env.step(ans("east"))[4]["steps"] == 1
    finally:
        env.close()


def test_crop_view():
    env = MiniHackRiverEnv(view="crop")
    try:
        obs, _ = env.reset(options={"task": 5})
        grid = parse_map(obs)
        assert len(grid) == 9 and grid[4][4] == "@"
        assert "You are at row 4, column 4" in obs
    finally:
        env.close()
    with pytest.raises(ValueError):
        MiniHackRoomEnv(view="wide")
    with pytest.raises(ValueError):
        MiniHackRoomEnv(variant="MiniHack-NoSuchThing-v0")


# ---- Room ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["MiniHack-Room-5x5-v0", "MiniHack-Room-Random-5x5-v0"])
def test_room_scripted_solver(variant):
    env = MiniHackRoomEnv(variant=variant)
    try:
        for task in (0, 1, 2, 1_000_000, 1_000_499):
            obs, reward, term, trunc, info, trace = play(env, room_policy, task, 20)
            assert (reward, term, trunc, info["success"], info["end_status"]) == (1.0, True, False, True, 2)
            # NLE blanks its buffers after the last step: the final observation keeps the map
            grid = parse_map(obs)
            assert "@" in "".join(grid) and ">" in "".join(grid)
            assert "Success" in obs
            assert info["steps"] == len(trace) - 1 <= 8
    finally:
        env.close()


def test_make_env_registry():
    env = make_env("minihack-room", max_steps=5)
    try:
        assert isinstance(env, MiniHackTextEnv) and env.max_steps == 5
        env.reset(options={"task": 0})
        ends = [env.step(ans("north"))[3] for _ in range(5)]
        assert ends == [False] * 4 + [True]
        for _ in range(30):  # many resets on one instance
            env.reset(options={"task": 0})
        obs, _ = env.reset()
        assert env.task in env.task_ids("train")
    finally:
        env.close()
        env.close()  # idempotent
    with pytest.raises(RuntimeError):
        env.reset(options={"task": 0})


def test_inner_step_limit_is_terminated():
    env = MiniHackRoomEnv(max_steps=10, inner_max_steps=3)
    try:
        env.reset(options={"task": 0})
        outs = [env.step(ans("north")) for _ in range(3)]
        obs, reward, term, trunc, info = outs[-1]
        assert [o[2] for o in outs] == [False, False, True]
        assert (reward, trunc, info["success"], info["end_status"]) == (0.0, False, False, -1)
        assert "step limit" in obs and parse_map(obs)
    finally:
        env.close()


def test_episode_limit_within_the_inner_step_limit():
    env = MiniHackRoomEnv(max_steps=2, inner_max_steps=6)
    try:
        env.reset(options={"task": 0, "max_steps": 5})         # an evaluation's limit (eval.max_steps)
        assert env.episode_max_steps == 5
        with pytest.raises(ValueError, match="above NLE's step limit 6"):
            env.reset(options={"task": 0, "max_steps": 7})
        env.reset(options={"task": 0})
        assert env.episode_max_steps == 2
    finally:
        env.close()


# ---- Maze ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("env_id", "limit", "within"), [("minihack-maze", 100, 37), ("minihack-maze-15x15", 300, 142)])
def test_the_explorer_solves_the_mazes_as_rendered(env_id, limit, within):
    """Every one of the first 20 eval mazes is solved with the env's own moves by frontier exploration over
    what the env has shown (envs/minihack/explore.py); the longest solution is bounded by what 50 tasks
    needed here (a changed NLE or renderer that hid passages would fail this)."""
    from crl_bench.envs.minihack.explore import explore_episode

    env = make_env(env_id)
    try:
        results = [explore_episode(env, t, limit) for t in env.task_ids("eval")[:20]]
    finally:
        env.close()
    assert all(ok for ok, _ in results), results
    assert max(n for _, n in results) <= within


def test_corridor_actions_and_the_explorer():
    """The corridor task has MiniHack's own corridor actions; ``kick`` asks for a direction that the next
    move gives; the explorer, searching for hidden passages and kicking stuck doors, solves the first 10
    eval tasks (on this machine 29 of the first 30 within 1,000 actions; task 1000010 is not shown
    solvable: its one way on is a corridor blocked by a boulder or a dead end)."""
    from crl_bench.envs.minihack.explore import explore_episode

    env = make_env("minihack-corridor")
    try:
        assert env.max_steps == 100
        assert env.admissible_actions() == MOVES + ["open", "kick", "search"]
        env.reset(options={"task": 1_000_011})
        obs, *_ = env.step(ans("kick"))
        assert "Last: In what direction?" in obs
        obs, _r, _t, _tr, info = env.step(ans("north"))
        assert info["steps"] == 2 and not info["invalid_action"] and "You kick at empty space." in obs
        results = [explore_episode(env, t, 1000) for t in env.task_ids("eval")[:10]]
    finally:
        env.close()
    assert all(ok for ok, _ in results), results


def test_maze_15x15_env_and_the_explorer_cli(capsys):
    from crl_bench.envs.minihack.explore import main

    env = make_env("minihack-maze-15x15")
    try:
        assert env.max_steps == 100 and env.variant == "MiniHack-MazeWalk-15x15-v0"
        assert env.admissible_actions() == list(MOVE_DELTAS)
    finally:
        env.close()
    assert main(["--env", "minihack-maze-15x15", "--episodes", "3", "--max-steps", "300"]) == 0
    assert "3 of 3 solved" in capsys.readouterr().out
    # within BALROG's 100 actions the explorer leaves the second task unsolved: exit 1, the task named
    assert main(["--env", "minihack-maze-15x15", "--episodes", "3"]) == 1
    assert "task 1000001: not solved in 100 actions" in capsys.readouterr().out

def test_maze_walls_and_messages(envs):
    env = envs[MiniHackMazeEnv]
    env.reset(options={"task": 4})
    messages = set()
    for _ in range(3):
        for a in MOVES:
            obs, reward, term, trunc, info = env.step(ans(a))
            assert not info["invalid_action"]
            if "Last: " in obs:
                messages.add(obs.split("Last: ")[1].splitlines()[0])
            if term or trunc:
                break
        if term or trunc:
            break
    assert messages & {"It's solid stone.", "It's a wall."}


# ---- KeyRoom -------------------------------------------------------------------------------------

def test_keyroom_apply_without_key(envs):
    env = envs[MiniHackKeyRoomEnv]
    env.reset(options={"task": 0})
    obs, reward, term, trunc, info = env.step(ans("apply"))
    assert not term and not info["invalid_action"] and "Nothing happens" in obs
    assert "Never mind" not in obs and "Key: not carried." in obs
    obs = env.step(ans("pickup"))[0]
    assert "Key: not carried." in obs


def test_keyroom_scripted_solver(envs):
    env = MiniHackKeyRoomEnv(max_steps=60)
    try:
        for task in (0, 11, 1_000_000):
            obs, reward, term, trunc, info, trace = play(env, keyroom_policy, task, 60)
            assert (reward, term, info["success"]) == (1.0, True, True)
            text = "\n".join(trace)
            assert "Key: carried." in text
            assert "You unlock the door with the key and open it." in text
            assert "' open door" in text  # drawn from glyphs, not as a wall
    finally:
        env.close()


# ---- River ---------------------------------------------------------------------------------------

def test_river_push_and_death():
    env = MiniHackRiverEnv(variant="MiniHack-River-Lava-v0", max_steps=40)
    try:
        obs, _ = env.reset(options={"task": 0})
        assert "} water" in obs or "~ lava" in obs or "` boulder" in obs
        for _ in range(40):
            obs, reward, term, trunc, info = env.step(ans("east"))
            if term or trunc:
                break
        assert term and reward == 0.0 and not info["success"] and info["end_status"] == 1
        assert "You died" in obs and "~ lava" in obs and "@" in "".join(parse_map(obs))
    finally:
        env.close()


def test_river_boulder_push(envs):
    """Walk next to a boulder with free floor behind it and push it (the boulder moves one cell)."""
    env = envs[MiniHackRiverEnv]
    pushed = 0
    for task in range(6):
        obs, info = env.reset(options={"task": task})
        grid = parse_map(obs)
        me = cells(grid, "@")[0]
        origin = (info["agent_xy"][1] - me[0], info["agent_xy"][0] - me[1])  # screen (y, x) of row 0/col 0
        plans = [(b, name, (b[0] - dr, b[1] - dc)) for b in cells(grid, "`")
                 for name, (dr, dc) in MOVE_DELTAS.items()
                 if dr == 0 and at(grid, b[0], b[1] + dc) == "." and at(grid, b[0], b[1] - dc) == "."]
        if not plans:
            continue
        boulder, push, stand = plans[0]
        for _ in range(30):
            grid = parse_map(obs)
            me = cells(grid, "@")[0]
            if me == stand:
                break
            move = first_move(grid, me, lambda c, goal=stand: c == goal)
            assert move is not None
            obs, _, term, trunc, info = env.step(ans(move))
            assert not (term or trunc)
            origin = (info["agent_xy"][1] - cells(parse_map(obs), "@")[0][0],
                      info["agent_xy"][0] - cells(parse_map(obs), "@")[0][1])
        obs, _, _, _, info = env.step(ans(push))
        assert (info["agent_xy"][1], info["agent_xy"][0]) == (origin[0] + boulder[0], origin[1] + boulder[1])
        assert "boulder" in obs.split("Last: ")[1]  # "With great effort you move the boulder."
        pushed += 1
    assert pushed >= 3


def test_offset_sentence_names_the_shortening_move():
    from crl_bench.envs.minihack import _offset_sentence

    assert _offset_sentence(3, -2) == "The stairs down are 3 south and 2 west of you (direction: southwest)."
    assert _offset_sentence(-1, 0) == "The stairs down are 1 north of you (direction: north)."
    assert _offset_sentence(0, 4) == "The stairs down are 4 east of you (direction: east)."
    assert _offset_sentence(0, 0) == "The stairs down are here."


def test_goal_offset_line_follows_the_agent():
    """Room-Random with goal_offset: the line agrees with the map's coordinates, and following its
    direction from any start reaches the stairs within the room's Chebyshev distance."""
    import re

    env = make_env("minihack-room", variant="MiniHack-Room-Random-5x5-v0", goal_offset=True, max_steps=8)
    plain = make_env("minihack-room", variant="MiniHack-Room-Random-5x5-v0", max_steps=8)
    try:
        for task in range(6):
            obs, _ = env.reset(options={"task": task})
            assert "direction:" not in plain.reset(options={"task": task})[0]
            r, c, gr, gc = map(int, re.search(r"You are at row (\d+), column (\d+)\. Stairs down at row (\d+), "
                                              r"column (\d+)\.", obs).groups())
            assert "direction: " in obs and abs(gr - r) <= 4
            for _ in range(4):
                way = re.search(r"\(direction: (\w+)\)", obs).group(1)
                obs, reward, terminated, truncated, info = env.step(f"<answer>{way}</answer>")
                if terminated:
                    break
            assert terminated and info["success"] and reward > 0, obs
    finally:
        env.close()
        plain.close()


# ---- package structure: prompts and renderer -----------------------------------------------------

def test_system_prompts_share_the_intro():
    from crl_bench.envs.minihack.actions import action_names
    from crl_bench.envs.minihack.prompts import intro

    for cls in [MiniHackTextEnv, *ENV_CLASSES]:
        assert cls.system_prompt.startswith(intro(cls.scene_text) + " " + cls.rules_text)
        assert cls.system_prompt == cls.build_system_prompt(cls.default_variant, action_names(cls.nle_actions))
    assert MiniHackMazeEnv.scene_text != MiniHackRoomEnv.scene_text
    env = MiniHackRoomEnv(variant="MiniHack-Room-Ultimate-5x5-v0")
    try:  # an instance's prompt adds its variant's notes
        assert env.system_prompt != MiniHackRoomEnv.system_prompt and "monster" in env.system_prompt
    finally:
        env.close()


def test_renderer_legend_with_many_glyphs():
    """Hundreds of distinct glyphs in one view (more than 1-byte ids or the 127 one-byte search keys
    cover): the legend still names each glyph from its first drawn cell in row-major order (the
    second one when the first is the agent's '@'), glyphs in increasing order."""
    import numpy as np
    from nle import nethack

    from crl_bench.envs.minihack import render

    rng = np.random.default_rng(0)
    h, w = (int(n) for n in nethack.DUNGEON_SHAPE)
    renderer = render.MapRenderer("full")
    words = [b"a thing", b"the key named K", b"floor of a room", b"wall", b"", b"an elf called x", b"a newt"]
    for n_glyphs in (5, 200, 400):  # one episode: the ids given grow past 127 and 254
        # monster and object glyphs (below the map symbols: none is redrawn, e.g. as an open door)
        glyphs = rng.choice(rng.choice(nethack.GLYPH_CMAP_OFF, size=n_glyphs, replace=False), size=(h, w))
        chars = rng.choice(np.frombuffer(b" .#-|+<>`}^(%?@abcdefgXYZ", np.uint8), size=(h, w))
        chars[0, 0] = chars[-1, -1] = ord("#")  # the bounding box is the whole screen
        x, y = 40, 10
        chars[y, x] = ord("@")
        descr = np.zeros((h, w, 80), np.uint8)
        for (r, c), g in np.ndenumerate(glyphs):
            word = words[g % len(words)] + (b" %d" % (g % 5) if g % len(words) == 0 else b"")
            descr[r, c, :len(word)] = np.frombuffer(word, np.uint8)
        obs = {"chars": chars, "glyphs": glyphs.astype(np.int16), "screen_descriptions": descr,
               "blstats": np.array([x, y] + [0] * 25)}
        assert renderer.capture(obs)
        meanings: dict[str, str] = {}
        for g in sorted(set(glyphs.ravel().tolist())):
            cells = [rc for rc in zip(*np.nonzero((glyphs == g) & (chars != 32))) if rc != (y, x)]
            if cells:
                r, c = cells[0]
                render._add_meaning(meanings, chr(chars[r, c]), g, {}, obs, r, c)
        meanings["@"] = "you" + (f" or {meanings['@']}" if "@" in meanings else "")
        assert renderer.frame.splitlines()[-2] == "Legend: " + render._legend(meanings)


def test_raw_retrieval_query_is_the_released_observation_dictionary():
    """query="raw": the released ``f"Observation: {raw_obs}"`` (NLE's dictionary as Python prints it,
    big arrays abbreviated by numpy), taken at the moment of the call (turn-level queries too)."""
    env = MiniHackRoomEnv(max_steps=5, query="raw")
    try:
        obs, _ = env.reset(options={"task": 3})
        q0 = env.retrieval_query(obs)
        assert q0.startswith("Observation: {'") and "'glyphs': array(" in q0 and "..." in q0
        assert "Map (row 0 is the top)" not in q0
        for move in ("north", "south", "east", "west"):    # one of them moves the agent
            env.step(f"<answer>{move}</answer>")
            q1 = env.retrieval_query("ignored")
            if q1 != q0:
                break
        assert q1.startswith("Observation: {'") and q1 != q0
    finally:
        env.close()
    with pytest.raises(ValueError, match="query must be"):
        MiniHackRoomEnv(query="rendered")


def test_raw_entries_are_keyed_as_released():
    """query="raw", raw_key="released": an episode's entries are keyed by the released
    ``build_memory_query(history[0])`` at episode end: NLE's arrays as they are at the end (NLE reuses
    its buffers) and MiniHack's crops (computed anew each step) of the state after the first reply
    when that reply was an action, else of the reset; raw_key="reset" keys by the query."""
    env = MiniHackRoomEnv(max_steps=6, query="raw", variant="MiniHack-Room-Random-5x5-v0")

    def text(live, crops):
        return "Observation: " + str({k: crops[k] if k.endswith("_crop") else live[k] for k in env.raw_keys})
    try:
        assert env.has_entry_key
        for task in range(20):                          # a task whose first move changes the crops
            env.reset(options={"task": task})
            reset = dict(env._raw_obs)
            _, _, term, _, _ = env.step("<answer>east</answer>")
            first = dict(env._raw_obs)
            if not term and str(first["chars_crop"]) != str(reset["chars_crop"]):
                break
        assert list(reset) == ["glyphs", "message", "chars_crop", "glyphs_crop", "screen_descriptions", "chars"]
        env.step("<answer>south</answer>")
        end = dict(env._raw_obs)
        assert env.entry_key(True) == text(end, first) != text(end, reset) == env.entry_key(False)
        env.reset(options={"task": task})
        reset = dict(env._raw_obs)
        assert env.retrieval_query("ignored") == text(reset, reset)
        env.step("<answer>fly</answer>")                # the first reply is no action: the reset's crops
        env.step("<answer>east</answer>")
        assert env.entry_key(True) == text(env._raw_obs, reset)
    finally:
        env.close()
    plain = MiniHackRoomEnv(query="raw", raw_key="reset")
    assert not plain.has_entry_key and plain.entry_key(True) is None
    plain.close()
    with pytest.raises(ValueError, match="raw_key"):
        MiniHackRoomEnv(query="raw", raw_key="late")
