"""``check_env`` (crl_bench/env_check.py): every registered env keeps the TextEnv contract, and the
checker fails on envs that break it, one property at a time, so it cannot pass vacuously.

Bounded: the first task of every split (one train and one eval task for ALFWorld and SWE-bench),
three policy actions per trajectory; SWE-bench runs on the synthetic instance in a real container
(the images of SWE-bench Verified are not on the test machines), in the ``containers`` xdist group."""

from __future__ import annotations

import json
import random
from importlib import metadata

import pytest

from crl_bench.env_api import ENTRY_POINT_GROUP, EnvUnavailableError, TextEnv, list_envs, make_env, register_env
from crl_bench.env_check import EnvCheckError, check_env, default_policy, main

# ---- every registered env ---------------------------------------------------------------------------

def _ours(env_id: str) -> bool:
    """An env this package declares (its engine is installed by the test extra; never skipped)."""
    eps = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return env_id in eps and eps[env_id].value.startswith("crl_bench.")


def _webshop_policy(env: TextEnv, obs: str, step: int) -> str:
    """A search on the search page (an open action set), else an admissible click."""
    if env.admissible_actions() is None:
        return "<answer>search[decorative pillow]</answer>"
    return default_policy(env, obs, step)


def _tool_call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def _swe_policy(env: TextEnv, obs: str, step: int) -> str:
    """Tool calls that read the working tree (the same output on every replay)."""
    return [_tool_call("bash", command="ls"),
            _tool_call("str_replace_editor", command="view", path="/testbed/calc/__init__.py"),
            _tool_call("bash", command="git status --short")][step % 3]


#: envs that need more than ``make_env(env_id)`` (a shared fixture, a policy, a container group)
SPECIAL = {"alfworld": [pytest.mark.xdist_group("alfworld")],
           "swebench-verified": [pytest.mark.xdist_group("containers"),         # one container engine user at a time
                                 pytest.mark.filterwarnings("ignore:swebench-verified. no task_list")]}


@pytest.mark.parametrize("env_id", [pytest.param(e, marks=SPECIAL.get(e, ())) for e in list_envs()])
def test_every_registered_env_keeps_the_contract(env_id, request):
    if env_id == "alfworld":          # the session's env (one worker per run); closing is checked on a second one
        env = request.getfixturevalue("alfworld_env")
        notes = check_env(env, close=False, make=lambda: make_env("alfworld"))
    elif env_id == "swebench-verified":
        env, notes = _check_swe(request)
    else:
        try:
            env = make_env(env_id)
        except EnvUnavailableError as e:
            if _ours(env_id):
                raise
            pytest.skip(f"a plugin env whose engine is not installed here: {e}")
        notes = check_env(env, make=lambda: make_env(env_id),
                          policy=_webshop_policy if env_id == "webshop" else None)
    assert env.env_id == env_id                                       # the id it is registered under
    assert not [n for n in notes if "all invalid" in n], notes       # the trajectories took real actions


def _check_swe(request) -> tuple[TextEnv, list[str]]:
    from swe_synthetic import build_task

    from crl_bench.envs.swebench.engine import docker_client
    from crl_bench.envs.swebench.sandbox import LABEL

    client = docker_client(timeout=600)

    def ours() -> set[str]:
        return {c.name for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"})}

    before = ours()
    instances = build_task(request.getfixturevalue("tmp_path"), client)
    env = make_env("swebench-verified", instances=str(instances))
    notes = check_env(env, policy=_swe_policy, make=lambda: make_env("swebench-verified", instances=str(instances)))
    # the default eval list is the training list: the same instance under two task ids, noted
    assert any("same fingerprint" in n for n in notes), notes
    assert ours() <= before, "check_env left a sandbox container behind"
    return env, notes


# ---- a small env that keeps the contract, and one break of it per property ---------------------------

class Walk(TextEnv):
    """Walk to position 6 with steps of 1, 2 or 3; the task id sets the start."""

    env_id = "test-walk"
    system_prompt = "Walk to 6. Reply with <answer>ACTION</answer>."
    splits = {"train": range(0, 50), "eval": range(50, 60)}

    def __init__(self, max_steps: int = 4) -> None:
        super().__init__(max_steps=max_steps)
        self.pos = 0

    def _reset_task(self, task):
        self.pos = task % 3

    def _apply(self, action):
        self.pos += {"one": 1, "two": 2, "three": 3}[action]
        won = self.pos == 6
        return float(won), self.pos >= 6, won, f"You walked {action}."

    def _observe(self, message=""):
        lines = [f"Task {self.task}: you are at {self.pos}."]
        if message:
            lines.append(f"Last: {message}")
        return "\n".join(lines)

    def admissible_actions(self):
        return ["one", "two", "three"]

    def task_prompt(self):
        return "walk to 6"

    def truncation_reward(self):
        return -1.0


class NondeterministicReset(Walk):
    def _reset_task(self, task):
        self.pos = random.randrange(1000)


class NondeterministicStep(Walk):
    def _apply(self, action):
        reward, term, won, _ = super()._apply(action)
        return reward, term, won, f"A gust of {random.randrange(10**9)} blows."


class OverlappingSplits(Walk):
    splits = {"train": range(0, 50), "eval": range(45, 60)}


class NoEvalSplit(Walk):
    splits = {"train": range(0, 50), "test": range(50, 60)}


class ShuffledTaskIds(Walk):
    splits = {"train": list(range(0, 50)), "eval": list(range(50, 60))}

    def task_ids(self, split):
        return random.sample(super().task_ids(split), len(super().task_ids(split)))


class CrashOnInvalid(Walk):
    def parse_action(self, reply):
        if "<answer>" not in reply:
            raise ValueError("no answer tag")
        return super().parse_action(reply)


class InvalidEndsEpisode(Walk):
    def step_wait(self):
        obs, reward, term, trunc, info = super().step_wait()
        if info["invalid_action"]:
            self._done, term = True, True
        return obs, reward, term, trunc, info


class SilentInvalid(Walk):
    """Drops the feedback: the agent is not told what was wrong."""

    def _observe(self, message=""):
        return f"Task {self.task}: you are at {self.pos}."


class MissingStepsKey(Walk):
    def _info(self, invalid, action=None):
        info = super()._info(invalid, action)
        del info["steps"]
        return info


class InfoOfWrongType(Walk):
    def _info(self, invalid, action=None):
        info = super()._info(invalid, action)
        info["success"] = int(info["success"])
        return info


class NoTruncation(Walk):
    """Never truncates: an episode of invalid actions runs past the step limit."""

    def step_wait(self):
        obs, reward, term, trunc, info = super().step_wait()
        self._done = term
        return obs, reward, term, False, info


class NoFailureReward(Walk):
    """Truncates, but without the failure reward it documents."""

    def step_wait(self):
        obs, reward, term, trunc, info = super().step_wait()
        return obs, reward - self.truncation_reward() if trunc else reward, term, trunc, info


class FingerprintNotJson(Walk):
    def task_fingerprint(self, task):
        return {"start": {self.check_task(task) % 3}}


class FingerprintOfState(Walk):
    def task_fingerprint(self, task):
        self.check_task(task)
        return {"start": self.pos}


class CloseTwiceFails(Walk):
    def close(self):
        if getattr(self, "closed", False):
            raise RuntimeError("already closed")
        self.closed = True


class AdmissibleNotParsed(Walk):
    def admissible_actions(self):
        return ["one", "two", "three", "jump"]

    def parser(self):
        from crl_bench.env_api import AnswerParser
        return AnswerParser(["one", "two", "three"])


class SeedIgnored(Walk):
    def reset_async(self, *, seed=None, options=None):
        super().reset_async(seed=None, options=options or {"task": 7})


class AcceptsUnknownIds(Walk):
    def check_task(self, task):
        return int(task)


#: each broken env and the properties the checker must find broken, no more (a reset that is not
#: deterministic also breaks the default fingerprint, the first observation, and the seeded reset)
BROKEN = [
    (NondeterministicReset, {"determinism", "fingerprint", "reset"}),
    (NondeterministicStep, {"determinism"}),
    (OverlappingSplits, {"splits"}),
    (NoEvalSplit, {"splits"}),
    (ShuffledTaskIds, {"task ids"}),
    (CrashOnInvalid, {"invalid action"}),
    (InvalidEndsEpisode, {"invalid action"}),
    (SilentInvalid, {"invalid action"}),
    (MissingStepsKey, {"info"}),
    (InfoOfWrongType, {"info"}),
    (NoTruncation, {"step limit"}),
    (NoFailureReward, {"step limit"}),
    (FingerprintNotJson, {"fingerprint"}),
    (FingerprintOfState, {"fingerprint"}),
    (CloseTwiceFails, {"close"}),
    (AdmissibleNotParsed, {"admissible actions"}),
    (SeedIgnored, {"reset"}),
    (AcceptsUnknownIds, {"unknown task id"}),
]


def test_an_env_that_keeps_the_contract_passes():
    notes = check_env(Walk(), make=Walk)
    assert notes == []
    assert check_env(Walk(max_steps=1)) == ["test-walk: no make= given: task ids and fingerprints were not "
                                            "compared with a second instance"]


@pytest.mark.parametrize("cls,props", BROKEN, ids=[c.__name__ for c, _ in BROKEN])
def test_check_env_fails_on_a_broken_env(cls, props):
    with pytest.raises(EnvCheckError) as e:
        check_env(cls(), make=cls)
    assert e.value.properties == props, str(e.value)
    assert all(str(f).startswith(f"test-walk: {'' if f.task is None else f'task {f.task}: '}{f.prop}: ")
               for f in e.value.failures), str(e.value)


class Unusual(Walk):
    """Allowed, and worth a note: no system prompt, an open action set, an id listed twice in a split,
    extra info JSON cannot hold and two tasks of the same content."""

    system_prompt = ""
    splits = {"train": [0, 1, 1, 3], "eval": [50, 53]}

    def admissible_actions(self):
        return None

    def _apply(self, action):
        if action in ("one", "two", "three"):
            return super()._apply(action)
        return 0.0, False, False, f"Nothing happens when you {action}."

    def extra_info(self):
        return {"visited": {self.pos}}

    def task_fingerprint(self, task):
        return {"start": self.check_task(task) % 3}


def test_what_is_allowed_is_noted_not_failed():
    notes = check_env(Unusual(), tasks=[0, 3, 50], make=Unusual)
    text = "\n".join(notes)
    for expected in ("system_prompt is empty", "open action set", "split 'train' lists a task id more than once",
                     "extra_info is not JSON-serialisable", "tasks 0 and 3 have the same fingerprint"):
        assert expected in text, text


def test_a_failure_names_the_env_the_task_and_the_property():
    with pytest.raises(EnvCheckError) as e:
        check_env(NoTruncation(), tasks=[3])
    assert e.value.properties == {"step limit"}, str(e.value)
    msg = str(e.value)
    assert msg.startswith("1 contract violation(s) of env 'test-walk':")
    assert "test-walk: task 3: step limit: 4 actions (max_steps) must end the episode as truncated" in msg


def test_check_env_rejects_what_is_not_a_text_env():
    with pytest.raises(TypeError, match="TextEnv"):
        check_env(object())


def test_command_line(capsys):
    assert main(["diag-vault", "--task", "160000", "--steps", "2"]) == 0
    assert "diag-vault: the env keeps the TextEnv contract" in capsys.readouterr().out
    assert main(["crl-bench-check-no-such-env"]) == 2
    register_env("test-check-broken", lambda **kw: NoTruncation(**kw))
    assert main(["test-check-broken", "--set", "max_steps=2"]) == 1
    assert "step limit: 2 actions (max_steps)" in capsys.readouterr().err
