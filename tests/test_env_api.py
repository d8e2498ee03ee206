"""Registry and base-class protocol."""

import sys

import gymnasium as gym
import pytest

from crl_bench.env_api import (
    EnvUnavailableError,
    TextEnv,
    data_file_map,
    list_envs,
    make_env,
    register_env,
    register_gymnasium,
    require_modules,
)


class _Half(TextEnv):
    def _reset_task(self, task):
        pass


def test_abstract_hooks_must_be_implemented():
    with pytest.raises(TypeError):
        _Half()


def test_registry_lists_builtin_envs_and_rejects_unknown():
    assert {"sokoban", "minihack-room", "minihack-maze", "minihack-keyroom", "minihack-river"} <= set(list_envs())
    with pytest.raises(KeyError, match="known:"):
        make_env("nope")
    with pytest.raises(TypeError):
        make_env("sokoban", no_such_setting=1)


def test_entry_point_must_return_text_env():
    register_env("test-not-a-text-env", lambda **kw: object())
    with pytest.raises(TypeError, match="not a TextEnv"):
        make_env("test-not-a-text-env")


def test_gymnasium_make_and_info_contract():
    register_gymnasium()
    env = gym.make("crl_bench/minihack-room", max_steps=3)
    obs, info = env.reset(options={"task": 1_000_000})
    assert isinstance(obs, str) and info["success"] is False and info["invalid_action"] is False
    assert info["admissible_actions"] and info["steps"] == 0
    obs, r, term, trunc, info = env.step("<answer>wait</answer>")
    assert info["invalid_action"] and info["invalid_actions"] == 1 and r == 0.0 and not term
    env.close()


def test_reset_seed_is_task_and_splits_are_disjoint():
    env = make_env("sokoban")
    a, _ = env.reset(seed=5)
    b, _ = env.reset(options={"task": 5})
    assert a == b and env.task == 5
    train, ev = env.task_ids("train"), env.task_ids("eval")
    assert not set(range(ev.start, ev.stop)) & set(range(train.start, min(train.stop, ev.stop)))
    with pytest.raises(KeyError):
        env.task_ids("test")


# ---- missing optional engines -----------------------------------------------------------------------

def _forget_modules(monkeypatch, package: str) -> None:
    """Drop the cached submodules of ``package`` (not the package itself, whose attributes still name
    them) for this test, so they import anew; monkeypatch puts them back afterwards."""
    for name in [m for m in sys.modules if m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)


def test_missing_webshop_engine_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "thefuzz", None)       # as if the [webshop] extra were absent
    _forget_modules(monkeypatch, "crl_bench.envs.webshop")
    with pytest.raises(EnvUnavailableError) as e:
        make_env("webshop")
    msg = str(e.value)
    assert "'webshop'" in msg and "[webshop]" in msg and "'thefuzz'" in msg
    assert "CRL_EXTRAS=webshop bash install.sh" in msg and "pip install 'crl-bench[webshop]'" in msg
    assert isinstance(e.value.__cause__, ImportError)


def test_missing_alfworld_engine_fails_at_construction(monkeypatch):
    # the engine is only imported by the worker process; the env checks for it when created
    monkeypatch.setitem(sys.modules, "textworld", None)
    with pytest.raises(EnvUnavailableError, match=r"needs the \[alfworld\] extra.*'textworld'"):
        make_env("alfworld")


def test_missing_module_of_a_plugin_gets_a_generic_message():
    def needs_missing():
        import crl_bench_no_such_engine_xyz  # noqa: F401 - the import itself is the test

    register_env("test-plugin-missing", lambda **kw: needs_missing())
    with pytest.raises(EnvUnavailableError, match="'crl_bench_no_such_engine_xyz'") as e:
        make_env("test-plugin-missing")
    assert "extra" not in str(e.value) and "test-plugin-missing" in str(e.value)
    register_env("test-plugin-missing-module", "crl_bench_no_such_pkg_abc.envs:Env")
    with pytest.raises(EnvUnavailableError, match="'crl_bench_no_such_pkg_abc'"):
        make_env("test-plugin-missing-module")


def test_a_wrapped_import_error_names_the_module_and_other_errors_pass_through():
    def wrapped(**kw):
        try:
            import crl_bench_no_such_index_lib  # noqa: F401 - the import itself is the test
        except ImportError as e:
            raise ImportError("the search needs crl_bench_no_such_index_lib") from e

    register_env("test-plugin-wrapped", wrapped)
    with pytest.raises(EnvUnavailableError, match="'crl_bench_no_such_index_lib'"):
        make_env("test-plugin-wrapped")

    def broken(**kw):
        raise ValueError("bad setting")

    register_env("test-plugin-broken", broken)
    with pytest.raises(ValueError, match="bad setting"):
        make_env("test-plugin-broken")


def test_require_modules():
    require_modules("sokoban", "json", "numpy")
    with pytest.raises(EnvUnavailableError, match=r"\[swe\] extra.*'crl_bench_no_such_sdk'"):
        require_modules("swebench-verified", "json", "crl_bench_no_such_sdk")


# ---- task_type / data_files hooks ---------------------------------------------------------------------

def test_default_hooks_and_data_file_map(tmp_path):
    env = make_env("sokoban")
    assert env.task_type(5) is None and env.data_files() == {}
    root = tmp_path / "data"
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "a.json").write_text("{}")
    outside = tmp_path / "list.txt"
    outside.write_text("x\n")
    files = data_file_map(root, [root / "bench" / "a.json", outside, root / "bench" / "missing.json",
                                 root / "bench"])
    assert files == {"bench/a.json": (root / "bench" / "a.json").absolute(),
                     outside.absolute().as_posix(): outside.absolute()}
    assert all(p.is_absolute() and p.is_file() for p in files.values())


@pytest.mark.filterwarnings("ignore:swebench-verified. no task_list")
def test_swebench_data_files_name_the_instance_file_and_task_list(tmp_path, monkeypatch):
    from crl_bench.envs.swebench import env as swe_env
    from crl_bench.envs.swebench.instances import load_instances

    monkeypatch.setattr(swe_env, "docker_client", lambda *a, **kw: object())   # no daemon needed here
    first = load_instances()[0].instance_id
    task_list = tmp_path / "keep.txt"
    task_list.write_text(first + "\n")
    env = swe_env.SWEBenchEnv(task_list=str(task_list), check_images=False)
    files = env.data_files()
    assert set(files) == {"swebench/SWE-bench_Verified.parquet", task_list.absolute().as_posix()}
    assert all(p.is_file() for p in files.values())
    assert set(swe_env.SWEBenchEnv(check_images=False).data_files()) == {"swebench/SWE-bench_Verified.parquet"}


class _Tagged(TextEnv):
    """An env with one extra info key (and optionally one that clashes with a common key)."""

    env_id = "test-tagged"
    splits = {"train": range(0, 5), "eval": range(5, 7)}
    clash = False

    def _reset_task(self, task):
        self.turns = 0

    def _apply(self, action):
        self.turns += 1
        return 0.0, False, False, ""

    def _observe(self, message=""):
        return "room"

    def admissible_actions(self):
        return ["wait"]

    def extra_info(self):
        return {"turns": self.turns, **({"steps": -1} if self.clash else {})}


def test_extra_info_hook_adds_keys_after_the_common_ones_and_may_not_replace_them():
    env = _Tagged(max_steps=3)
    _, info = env.reset(options={"task": 0})
    assert list(info)[-1] == "turns" and info["turns"] == 0
    _, _, _, _, info = env.step("<answer>wait</answer>")
    assert info["turns"] == 1 and info["steps"] == 1 and info["admissible_actions"] == ["wait"]
    env.clash = True
    with pytest.raises(KeyError, match="steps"):
        env.step("<answer>wait</answer>")


def test_reply_format_default_and_the_swe_env_constructor_settings():
    from crl_bench.env_api import DEFAULT_REPLY_INSTRUCTION, ReplyFormat

    assert TextEnv.reply_format == ReplyFormat(DEFAULT_REPLY_INSTRUCTION, None, 0, ())
    from crl_bench.envs.swebench.env import SWEBenchEnv

    fmt = SWEBenchEnv.reply_format
    assert fmt.stop == ("</tool_call>",) and fmt.min_new_tokens == 384 and "<tool_call>" in fmt.instruction


def test_the_methods_are_declared_in_one_place_and_names_are_not_reused():
    from crl_bench.methods import COMPLEMENTARY, MethodSpec, get_method, list_methods, register_method

    assert list_methods() == ["casebank", "complementary", "expel", "grpo", "internalise", "reflexion", "static"]
    assert get_method("complementary") is COMPLEMENTARY and COMPLEMENTARY.trains_extractor
    with pytest.raises(ValueError, match="already declared"):
        register_method(MethodSpec("grpo", "a different grpo", uses_experience=True))
    with pytest.raises(KeyError, match="known: casebank, complementary, expel, grpo, internalise, reflexion, static"):
        get_method("nope")


def test_a_method_names_a_registered_memory_kind():
    from crl_bench.methods import MethodSpec

    with pytest.raises(ValueError, match="unknown memory kind 'notes'; known: cases, insights, lessons, reflections"):
        MethodSpec("x", "a bank of notes", uses_experience=True, memory="notes")
    with pytest.raises(ValueError, match="extractor to train"):
        MethodSpec("y", "a trained case bank", uses_experience=True, trains_extractor=True, memory="cases")
    with pytest.raises(TypeError, match="entries"):       # the kind is named by memory=, as in the CHANGELOG
        MethodSpec("z", "the old keyword", uses_experience=True, entries="cases")
    assert MethodSpec("w", "ExpeL", uses_experience=True, memory="insights").uses_extractor
