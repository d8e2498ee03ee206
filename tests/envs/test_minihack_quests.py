"""The MiniHack tasks with fights (envs/minihack/quests.py), on real NLE: the corridor battle and the two
quests, BALROG's CorridorBattle-Dark, Quest-Easy and Quest-Medium."""

from __future__ import annotations

import pytest

from crl_bench.env_api import make_env
from crl_bench.envs.minihack import MOVE_DELTAS
from crl_bench.envs.minihack.explore import explore_episode, main

MOVES = list(MOVE_DELTAS)


def ans(action: str) -> str:
    return f"<answer>{action}</answer>"


def last(obs: str) -> str:
    """The ``Last:`` line of an observation (``""`` without one)."""
    return next((line[6:] for line in obs.splitlines() if line.startswith("Last: ")), "")


def test_corridor_battle_env():
    env = make_env("minihack-corridor-battle")
    try:
        assert env.variant == "MiniHack-CorridorBattle-Dark-v0" and env.max_steps == 100
        assert env.admissible_actions() == MOVES
        obs, _ = env.reset(options={"task": 1_000_000})
        # the Knight's greeting is not shown; the hit points are; the level is dark (3x3 seen)
        assert "welcome to NetHack" not in obs and "HP: 16 of 16." in obs
        assert obs.splitlines()[1:4] == ["..|", ".@.", "..|"]
        assert "The level is dark" in env.system_prompt and "giant rats" in env.system_prompt
        again, _ = env.reset(options={"task": 1_000_000})
        assert again == obs
    finally:
        env.close()
    lit = make_env("minihack-corridor-battle", variant="MiniHack-CorridorBattle-v0")
    try:
        obs, _ = lit.reset(options={"task": 1_000_000})
        assert obs.count("r") >= 6 and "r giant rat" in obs and "> stairs down (goal)" in obs
        assert "The level is dark" not in lit.system_prompt
    finally:
        lit.close()


def test_quest_zap_freezes_the_lava_and_lava_kills():
    env = make_env("minihack-quest-easy")
    try:
        assert env.admissible_actions() == MOVES + ["zap"] and env.max_steps == 100
        assert "wand of cold" in env.system_prompt and "Other actions: zap." in env.system_prompt
        obs, _ = env.reset(options={"task": 1_000_000})
        assert "Wand: carried." in obs and "HP: 16 of 16." in obs and "~ lava" in obs
        # four steps east from the start is the lava column: death
        for _ in range(3):
            env.step(ans("east"))
        obs, reward, term, _tr, info = env.step(ans("east"))
        assert term and reward == 0.0 and not info["success"] and info["end_status"] == 1 and "You died" in obs

        env.reset(options={"task": 1_000_000})
        for _ in range(3):
            env.step(ans("east"))
        obs, *_ = env.step(ans("zap"))                       # the env picks the wand; NetHack asks
        assert last(obs) == "In what direction?"
        obs, _r, term, _tr, info = env.step(ans("east"))     # the next move gives the direction
        assert "The lava cools and solidifies." in last(obs) and not term and info["steps"] == 5
        obs, _r, term, _tr, info = env.step(ans("east"))     # onto the frozen lava, alive
        assert not term and info["end_status"] == 0
        # zap while NetHack waits for a direction: the key is NetHack's answer (a strange direction)
        env.step(ans("zap"))
        obs, *_ = env.step(ans("freeze"))                    # an alias of zap
        assert "strange direction" in last(obs)
        # the wand stays hidden from the actor: its letter is no action
        obs, _r, _t, _tr, info = env.step(ans("g"))
        assert info["invalid_action"]
    finally:
        env.close()


def test_quest_medium_is_a_knight_with_rats_and_lava():
    env = make_env("minihack-quest-medium")
    try:
        obs, _ = env.reset(options={"task": 1_000_000})
        assert env.variant == "MiniHack-Quest-Medium-v0" and "Wand: carried." in obs
        assert "giant rats" in env.system_prompt and "welcome to NetHack" not in obs
    finally:
        env.close()


def test_a_peaceful_monster_is_not_attacked(monkeypatch):
    """NetHack's "Really attack the ...?" (moving into a peaceful monster) is declined by the env: it would
    wait for y/n, which no action is. The message says so and the game goes on. (The question is put in
    NLE's message buffer after a real step: the quests' random monsters are rarely peaceful.)"""
    from crl_bench.envs.minihack.env import MiniHackTextEnv

    real_send = MiniHackTextEnv._send
    asked = []

    def send(self, action):
        result = real_send(self, action)
        if not asked:
            asked.append(action)
            msg = b"Really attack the gnome lord? [yn] (n)"
            buf = self._nle.last_observation[self._nle._message_index]
            buf[:] = 0
            buf[:len(msg)] = list(msg)
        return result

    monkeypatch.setattr(MiniHackTextEnv, "_send", send)
    env = make_env("minihack-quest-easy")
    try:
        env.reset(options={"task": 1_000_000})
        obs, _r, term, _tr, info = env.step(ans("north"))
        assert last(obs) == "Really attack the gnome lord? [yn] (n) You did not attack: it is peaceful."
        assert not term and info["end_status"] == 0 and asked == ["north"]
        obs, *_ = env.step(ans("south"))
        assert "You did not attack" not in obs
    finally:
        env.close()


@pytest.mark.parametrize(("env_id", "hold", "solved"), [("minihack-corridor-battle", 16, 9),
                                                         ("minihack-quest-easy", 0, 7),
                                                         ("minihack-quest-medium", 16, 8)])
def test_the_explorer_wins_most_fights_as_rendered(env_id, hold, solved):
    """Solvable as rendered: the explorer (envs/minihack/explore.py), walking into monsters, zapping the
    lava next to it when nothing else is reachable and, with ``hold``, fighting from the corridor before
    entering a room, wins at least ``solved`` of the first 10 eval tasks within BALROG's 100 actions (the
    fights are NetHack's, seeded per task, so the count is the same on every run of this NLE build; on
    this machine 43, 46 and 44 of the first 50)."""
    env = make_env(env_id)
    try:
        results = [explore_episode(env, t, hold=hold) for t in env.task_ids("eval")[:10]]
    finally:
        env.close()
    assert sum(ok for ok, _ in results) >= solved, results
    assert max(n for _, n in results) <= 100


def test_the_explorer_cli_holds(capsys):
    assert main(["--env", "minihack-corridor-battle", "--episodes", "2", "--hold", "16"]) in (0, 1)
    out = capsys.readouterr().out
    assert out.startswith("minihack-corridor-battle eval: ") and " of 2 solved" in out
