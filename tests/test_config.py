import pytest

from crl_bench.config import ConfigError, build_config, list_presets, parse_override, preset_data
from crl_bench.mixtures import TaskSampler, resolve_mixture


def test_presets_load():
    assert {"default", "smoke", "cpu", "paper"} <= set(list_presets())
    for name in list_presets():
        build_config([preset_data(name)])


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="'train.lrr'"):
        build_config([{"train": {"lrr": 1e-5}}])
    with pytest.raises(ConfigError, match="'trainer'"):
        build_config([{"trainer": {}}])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="train.group_size"):
        build_config([{"train": {"group_size": "eight"}}])
    with pytest.raises(ConfigError, match="generation.constrained"):
        build_config([{"generation": {"constrained": "yes"}}])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="train.group_size"):
        build_config([{"train": {"group_size": 0}}])
    for key, value in (("train.loss_agg", "sum"), ("extractor.format", "xml"), ("experience.key", "title"),
                       ("experience.distill", "free"), ("rollout.prompt", "full"),
                       ("experience.placement", "footer"), ("experience.warmup_steps", -1)):
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=key):
            build_config([{section: {name: value}}])
    with pytest.raises(ConfigError, match="train.recompute_old_logprobs"):
        build_config([{"generation": {"engine": "vllm"}, "train": {"recompute_old_logprobs": False}}])
    with pytest.raises(ConfigError, match="generation.engine=vllm runs with backend=local"):
        build_config([{"backend": "ray", "generation": {"engine": "vllm"}}])
    with pytest.raises(ConfigError, match="train.sharding=fsdp cannot take a KL term with model.lora"):
        build_config([{"train": {"workers": 2, "sharding": "fsdp", "kl_coef": 0.01}, "model": {"lora": True}}])
    build_config([{"train": {"workers": 2, "sharding": "ddp", "kl_coef": 0.01}, "model": {"lora": True}}])


def test_released_defaults():
    """Without a preset every method setting is the released code's (docs/method.md)."""
    cfg = build_config([])
    assert cfg.train.loss_agg == "seq-mean-token-mean" and cfg.train.recompute_old_logprobs
    assert cfg.extractor.reward == "binary"
    assert (cfg.experience.key, cfg.experience.distill, cfg.experience.placement) == ("query", "guided", "system")
    assert cfg.experience.warmup_steps == 5 and cfg.experience.flush_before_rollout
    assert cfg.experience.actor_critic


def test_override_parsing_and_precedence():
    cfg = build_config([preset_data("smoke"), parse_override("train.lr=3e-4"),
                        parse_override("rollout.env_kwargs={sokoban: {search_depth: 10}}")])
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.train.steps == 2
    assert cfg.rollout.env_kwargs == {"sokoban": {"search_depth": 10}}
    with pytest.raises(ConfigError):
        parse_override("train.lr")


def test_overrides_of_one_env_s_settings_add_up():
    """Two --set of the same env's constructor settings keep both (a shallow merge kept the last)."""
    cfg = build_config([preset_data("cpu"),
                        parse_override("rollout.env_kwargs.minihack-room.variant=MiniHack-Room-5x5-v0"),
                        parse_override("rollout.env_kwargs.minihack-room.view=crop"),
                        parse_override("rollout.env_kwargs.sokoban.search_depth=10")])
    assert cfg.rollout.env_kwargs == {"minihack-room": {"variant": "MiniHack-Room-5x5-v0", "goal_offset": True,
                                                        "view": "crop"},
                                      "sokoban": {"search_depth": 10}}


def test_mixtures():
    m = resolve_mixture("6task")
    assert set(m.envs) == {"minihack-room", "webshop", "alfworld", "minihack-maze", "minihack-keyroom", "sokoban"}
    assert sum(m.weights) == pytest.approx(1.0)
    m = resolve_mixture("sokoban:3,minihack-room:1")
    assert m.weights == pytest.approx((0.75, 0.25))
    with pytest.raises(ConfigError):
        resolve_mixture("sokoban:-1")
    s = TaskSampler(resolve_mixture("sokoban"), {"sokoban": range(10, 20)}, seed=3)
    draws = s.sample(50)
    assert all(e == "sokoban" and 10 <= t < 20 for e, t in draws)
    assert draws == TaskSampler(resolve_mixture("sokoban"), {"sokoban": range(10, 20)}, seed=3).sample(50)


def test_task_sampler_uses_env_task_weights():
    from crl_bench.mixtures import TaskSampler, resolve_mixture

    mix = resolve_mixture("sokoban")
    ids = [10, 11, 12]
    s = TaskSampler(mix, {"sokoban": ids}, seed=0, task_weights={"sokoban": [0.0, 3.0, 1.0]})
    draws = [t for _, t in s.sample(4000)]
    assert 10 not in draws
    assert abs(draws.count(11) / len(draws) - 0.75) < 0.03
    uniform = [t for _, t in TaskSampler(mix, {"sokoban": ids}, seed=0).sample(3000)]
    assert all(abs(uniform.count(t) / 3000 - 1 / 3) < 0.04 for t in ids)
    with pytest.raises(ValueError, match="non-negative"):
        TaskSampler(mix, {"sokoban": ids}, seed=0, task_weights={"sokoban": [1.0, -1.0, 1.0]})


def test_logging_config_validation():
    cfg = build_config([])
    assert cfg.logging.backends == ["jsonl"] and cfg.logging.wandb_project == "crl-bench"
    assert cfg.logging.wandb_mode == "offline" and cfg.logging.tensorboard_dir == ""
    with pytest.raises(ConfigError, match="logging.backends.*'mlflow'"):
        build_config([{"logging": {"backends": ["jsonl", "mlflow"]}}])
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        build_config([{"logging": {"wandb_mode": "sometimes"}}])
    with pytest.raises(ConfigError, match="logging.backends"):
        build_config([{"logging": {"backends": 3}}])
    with pytest.raises(ConfigError, match="'logging.backend'"):
        build_config([{"logging": {"backend": ["jsonl"]}}])
    assert build_config([{"logging": {"backends": ["tensorboard", "tensorboard"]}}]).logging.backends == \
        ["tensorboard"]
    cfg = build_config([parse_override("logging.backends=[jsonl, wandb]"),
                        parse_override("logging.wandb_mode=disabled")])
    assert cfg.logging.backends == ["jsonl", "wandb"] and cfg.logging.wandb_mode == "disabled"
    assert build_config([parse_override("logging.backends=tensorboard")]).logging.backends == ["tensorboard"]


def test_the_method_is_resolved_in_the_config_alone(monkeypatch):
    """``RunConfig.method_spec`` is the one lookup of a run's method name: the declared spec, a plugin's
    registered spec, and a ``ConfigError`` naming the key for an unknown name. Outside the registry
    itself, the config, the CLI's ``--method`` check and the summary (which reads method names from
    files), no module of the package resolves a method name again."""
    import ast
    from dataclasses import replace
    from pathlib import Path

    from crl_bench import methods
    from crl_bench.config import RunConfig
    from crl_bench.methods import COMPLEMENTARY, MethodSpec

    assert RunConfig(method="complementary").method_spec is COMPLEMENTARY
    plugin = MethodSpec(name="test-plugin-method", description="a plugin", uses_experience=True)
    monkeypatch.setitem(methods._METHODS, plugin.name, plugin)      # registered for this test only
    assert replace(RunConfig(), method="test-plugin-method").method_spec is plugin
    with pytest.raises(ConfigError, match=r"^method: unknown method 'nope'; known: .*complementary"):
        RunConfig(method="nope").method_spec   # noqa: B018 - the property raises

    root = Path(__file__).resolve().parents[1]
    allowed = {"crl_bench/methods.py", "crl_bench/config.py", "crl_bench/commands/options.py",
               "crl_bench/results/summary.py"}
    calls = []
    for top in ("crl_bench", "trainer", "envs", "baselines"):
        for path in sorted((root / top).rglob("*.py")):
            rel = str(path.relative_to(root))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                name = getattr(node.func, "id", getattr(node.func, "attr", "")) if isinstance(node, ast.Call) else ""
                if name == "get_method" and rel not in allowed:
                    calls.append(f"{rel}:{node.lineno}")
    assert not calls, f"a method name resolved outside RunConfig.method_spec: {calls}"


def test_the_paper_preset_trains_on_the_released_minihack_room():
    """The released example (``examples/singletask-agentic/single_task_complementaryrl.yaml``, tags
    ``MiniHackRoomUltimate`` for training and validation) runs ``MiniHack-Room-Ultimate-5x5-v0``: a
    random room, dark, with a monster and a trap, so tasks differ and so do their retrieval queries."""
    from crl_bench.env_api import make_env

    cfg = build_config([preset_data("paper")])
    assert cfg.rollout.mix == "minihack-room"
    kwargs = cfg.rollout.env_kwargs["minihack-room"]
    assert kwargs == {"variant": "MiniHack-Room-Ultimate-5x5-v0"}
    env = make_env("minihack-room", **kwargs)
    try:
        queries = {env.retrieval_query(env.reset(options={"task": t})[0]) for t in env.task_ids("train")[:4]}
    finally:
        env.close()
    assert len(queries) > 1                 # the rooms differ by task (one fixed layout would give one)


def test_old_flat_experience_keys_are_read_under_their_new_names():
    """The keys of the memory kinds' sections (``experience.cases.*``, ``.insights.*``,
    ``.reflections.*``, ``.merge.*``, ``.utility.*``) are read under their flat names too, through the
    one rename table, with a DeprecationWarning naming old and new key; a key given under both names
    is an error."""
    from crl_bench.config import RENAMED_KEYS

    old = {"cases": "all", "case_tokens": 128, "insight_pairs": 2, "insight_successes": 3, "insight_ops": 5,
           "insights_max": 7, "insight_new_tokens": 99, "reflections_shown": 2, "reflection_tokens": 32,
           "merge_every": 3, "merge": "similar", "merge_max": 4, "merge_threshold": 0.7, "utility_alpha": 0.6,
           "utility_ucb": 0.5, "utility_min_sim": 0.3, "utility_beta": 0.1}
    assert {f"experience.{k}" for k in old} == set(RENAMED_KEYS)
    with pytest.warns(DeprecationWarning, match=r"experience.case_tokens -> experience.cases.tokens"):
        cfg = build_config([{"experience": old}])
    for key, value in old.items():
        section, leaf = RENAMED_KEYS[f"experience.{key}"].split(".")[1:]
        assert getattr(getattr(cfg.experience, section), leaf) == value, key
    new = build_config([{"experience": {"merge": {"every": 3, "mode": "similar"}}}])
    assert (new.experience.merge.every, new.experience.merge.mode) == (3, "similar")
    with pytest.warns(DeprecationWarning):           # --set with the old name
        assert build_config([parse_override("experience.merge_max=6")]).experience.merge.max == 6
    with pytest.raises(ConfigError, match="experience.merge.every is given by its old and its new name"):
        build_config([{"experience": {"merge": {"every": 2}, "merge_every": 3}}])
    assert "case_tokens" not in str(build_config([]).to_dict())      # config.yaml is written nested


def test_committed_run_configs_still_load():
    """Every committed run folder's config.yaml (written with the flat keys) builds, its settings read
    under the new names."""
    import warnings
    from pathlib import Path

    from crl_bench.config import load_yaml

    paths = sorted(Path(__file__).resolve().parents[1].glob("results/**/config.yaml"))
    assert paths
    for path in paths:
        data = load_yaml(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cfg = build_config([data])
        exp = data.get("experience", {})
        if "merge_every" in exp:
            assert cfg.experience.merge.every == exp["merge_every"], path
        if "case_tokens" in exp:
            assert cfg.experience.cases.tokens == exp["case_tokens"], path
