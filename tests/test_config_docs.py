"""The config documents and checks itself: every key has its doc beside it, choice keys are checked
from their ``Literal`` type, bounds from ``Annotated``, non-finite numbers and keys given twice are
refused, and docs/configuration.md's key tables are the ones the code generates."""

import dataclasses
import typing
from pathlib import Path

import pytest

from crl_bench import config_docs
from crl_bench.config import RunConfig, build_config, load_yaml, parse_override
from crl_bench.config_schema import ConfigError, choices, field_docs, reference_rows, section_hints

REPO = Path(__file__).resolve().parents[1]


def _sections(cls=RunConfig, prefix=""):
    yield prefix, cls
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(type(value), f"{prefix}{f.name}.")


def test_configuration_page_key_tables_are_current():
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert config_docs.update_page(page) == page, \
        "docs/configuration.md is stale: run `python -m crl_bench.config_docs docs/configuration.md`"


def test_every_key_has_its_doc_beside_it():
    missing = [f"{prefix}{f.name}" for prefix, cls in _sections() for f in dataclasses.fields(cls)
               if not field_docs(cls).get(f.name)]
    assert not missing, missing
    keys = [r[0] for r in reference_rows(RunConfig)]
    assert len(keys) == len(set(keys)) and len(keys) > 150
    assert "experience.merge.mode" in keys and "train.group_size" in keys


def test_choice_keys_are_checked_from_their_type():
    rows = 0
    for prefix, cls in _sections():
        for name, tp in section_hints(cls).items():
            allowed = choices(tp)
            if not allowed:
                continue
            rows += 1
            key = f"{prefix}{name}"
            with pytest.raises(ConfigError, match=f"{key}.*valid: {allowed[0]}"):
                build_config([parse_override(f"{key}=not-a-choice")])
    assert rows >= 20


def test_module_tuples_are_the_config_types():
    from crl_bench.experience.cases import CASE_OUTCOMES
    from crl_bench.experience.vector_index import INDEX_KINDS
    from crl_bench.prompts import PROMPT_LAYOUTS
    from crl_bench.trainer.data_parallel import SHARDINGS
    from crl_bench.trainer.evaluation import EVAL_CONTROLS
    from crl_bench.trainer.policy import LOSS_AGGS, SEQUENCE_LAYOUTS

    hints = {p: section_hints(c) for p, c in _sections()}
    assert choices(hints["rollout."]["prompt"]) == PROMPT_LAYOUTS
    assert choices(hints["experience."]["index"]) == INDEX_KINDS
    assert choices(hints["experience.cases."]["outcomes"]) == CASE_OUTCOMES
    assert choices(hints["train."]["sharding"]) == SHARDINGS
    assert choices(hints["train."]["loss_agg"]) == LOSS_AGGS
    assert choices(hints["train."]["sequences"]) == SEQUENCE_LAYOUTS
    assert choices(typing.get_args(hints["eval."]["controls"])[0]) == EVAL_CONTROLS


@pytest.mark.parametrize("override, message", [
    ("train.steps=-1", "train.steps: -1 (must be >= 0)"),
    ("train.steps=1000000000", "train.steps: 1000000000 (must be <= "),
    ("train.group_size=10000000", "train.group_size"),
    ("generation.top_p=0", "generation.top_p: 0.0 (must be > 0)"),
    ("generation.vllm_kv_cache_gb=0", "generation.vllm_kv_cache_gb: 0.0 (must be > 0)"),
    ("experience.merge.max=1", "experience.merge.max: 1 (must be >= 2)"),
    ("experience.free_size=8", "experience.free_size: 8"),
    ("experience.insights.successes=1", "experience.insights.successes: 1"),
    ("eval.episodes=some", "eval.episodes: 'some'"),
    ("eval.controls=[shuffled, none]", "eval.controls: 'none'"),
    ("train.lr=.nan", "train.lr: expected a finite number"),
    ("extractor.eps_low=.inf", "extractor.eps_low: expected a finite number"),
])
def test_bad_values_name_their_key(override, message):
    with pytest.raises(ConfigError) as e:
        build_config([parse_override(override)])
    assert message in str(e.value)


def test_lists_accept_a_comma_separated_string():
    cfg = build_config([parse_override("eval.controls=empty"), parse_override("logging.backends=jsonl,jsonl")])
    assert cfg.eval.controls == ["empty"] and cfg.logging.backends == ["jsonl"]


def test_values_set_in_code_are_checked_too():
    cfg = RunConfig()
    cfg.train.sharding = "zero3"
    with pytest.raises(ConfigError, match="train.sharding"):
        from crl_bench.config import validate
        validate(cfg)


def test_config_file_refuses_keys_given_twice_and_non_finite_numbers(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 1.0e-5\n  steps: 2\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match="'lr' is given twice"):
        load_yaml(twice)
    nan = tmp_path / "nan.yaml"
    nan.write_text("train:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match="train.lr: expected a finite number"):
        build_config([load_yaml(nan)])
    merged = tmp_path / "merged.yaml"          # a merge key may be overridden: that is YAML's intent
    merged.write_text("base: &b {lr: 1.0e-5, steps: 2}\ntrain:\n  <<: *b\n  steps: 3\n")
    assert load_yaml(merged)["train"] == {"lr": 1.0e-5, "steps": 3}


def test_greedy_groups_warn():
    with pytest.warns(UserWarning, match="generation.temperature=0 with train.group_size=8"):
        build_config([parse_override("generation.temperature=0")])
