"""Property-based fuzzing (hypothesis) of everything that reads model text or applies its result.

Random and adversarial strings go through the actor reply parser, both extractor operation parsers and
``ExperienceBank.apply`` on the flat, IVF and HNSW indexes. Checked: nothing raises, parsers return only
well-formed results, and after every apply the bank's SQLite rows equal its FAISS index (same ids,
once each), ``rows == index size`` and SQLite's integrity check passes.

Deterministic in CI: ``derandomize=True`` (examples derived from the test, not the clock), no example
database written into the checkout, no deadline (a loaded machine must not fail a test).
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crl_bench.env_api import AnswerParser
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.json_ops import parse_json_operations
from crl_bench.experience.operations import parse_operations
from crl_bench.experience.types import OP_KINDS, Operation
from crl_bench.experience.validation import REJECTION_REASONS

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=150,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BANK_FUZZ = settings(FUZZ, max_examples=40)

ACTIONS = ["north", "east", "south", "west", "northeast", "southeast", "southwest", "northwest"]
# pieces the formats are made of, so random text often comes close to a valid reply
TOKENS = ["<answer>", "</answer>", "< answer >", "</ANSWER>", "<think>", "</think>", "<ops>", "</ops>",
          "<op>", "</op>", "< / op >", "<title>", "</title>", "<content>", "</content>", "ADD", "UPDATE",
          "MERGE", "NONE", "REFINE", "add", "#3", "[2]", "1", "2", "99999999999999999999", "-1", "inf",
          "nan", "1e308", ",", " ", "\n", "\t", "\x00", "\ud800", "\udfff", "\u202e", "é", "漢", "🙂",
          '{"function_name": "add", "parameters": {"title": "t", "content": "c"}}',
          '{"function_name": "update", "parameters": {"target_ids": [1, 99999999999999999999], '
          '"title": "t", "content": "c"}}', '{"function_name": "return"}', "[", "]", "{", "}", '"', "```json",
          "```", "'; DROP TABLE entries; --", "NULL", *ACTIONS]
model_text = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=12)), max_size=40).map("".join),
)


@FUZZ
@given(model_text)
def test_actor_reply_parser_never_raises(reply):
    for parser in (AnswerParser(ACTIONS), AnswerParser(None)):
        parsed = parser.parse(reply)
        if parser.actions is not None and parsed.action is not None:
            assert parsed.action in ACTIONS
        if parsed.action is None:
            assert parsed.error
        assert isinstance(parsed.raw, str)


def _check_ops(res, allowed_ids=None):
    for op in res.ops:
        assert isinstance(op, Operation) and op.kind in OP_KINDS
        if op.kind in ("ADD", "UPDATE", "MERGE"):
            assert op.title.strip() and op.content.strip()
            op.title.encode("utf-8")
            op.content.encode("utf-8")
        if allowed_ids is not None:
            assert set(op.targets) <= set(allowed_ids)
        assert all(isinstance(t, int) for t in op.targets)


@FUZZ
@given(model_text, st.lists(st.integers(min_value=1, max_value=50), max_size=5))
def test_extractor_parsers_never_raise(reply, shown):
    for text in (reply, "<ops>\n<op>" + reply):
        _check_ops(parse_operations(text))
        _check_ops(parse_operations(text, known_ids=shown), shown)
    for text in (reply, "<answer>" + reply, "<answer>[" + reply + "]</answer>"):
        _check_ops(parse_json_operations(text, shown), shown)


bad_ids = st.one_of(st.integers(min_value=-3, max_value=40), st.integers(min_value=2 ** 62),
                    st.sampled_from([float("inf"), float("-inf"), float("nan"), 2.5, True, "3", None, 10 ** 30]))
operations = st.builds(
    Operation,
    kind=st.one_of(st.sampled_from(list(OP_KINDS)), st.sampled_from(["add", "DELETE", "", "REFINE"])),
    title=st.one_of(model_text, st.text(min_size=1, max_size=20)),
    content=st.one_of(model_text, st.text(min_size=1, max_size=40), st.just("x" * 1001)),
    targets=st.one_of(st.lists(bad_ids, max_size=4).map(tuple), st.just(7)),
)


def _bank(folder: Path, kind: str) -> ExperienceBank:
    # small IVF / HNSW thresholds so the fuzz reaches training, tombstones and rebuilds
    return ExperienceBank(folder / "bank.sqlite", HashEmbedder(32), index=kind, capacity=25, ivf_min_train=8,
                          ivf_nlist=4, hnsw_rebuild_min=2, hnsw_rebuild_fraction=0.1, max_text_chars=1000)


def _check_bank(bank: ExperienceBank) -> None:
    ids, _ = bank.index_snapshot()
    ids = ids.tolist()
    assert len(ids) == len(set(ids)) == len(bank)            # rows == index size, each id once
    assert set(ids) == set(bank._db_vectors())
    con = sqlite3.connect(bank.path)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_bank_apply_never_raises_and_stays_consistent(kind):
    @BANK_FUZZ
    @given(st.lists(st.lists(operations, max_size=6), min_size=1, max_size=6))
    def run(replies):
        with tempfile.TemporaryDirectory() as d:
            bank = _bank(Path(d), kind)
            try:
                for step, ops in enumerate(replies):
                    env = "a" if step % 2 else "b"
                    res = bank.apply(ops, env_id=env, step=step, extraction_id=f"x{step}", extractor_version=0)
                    assert len(res.applied) + len(res.rejected) == len(ops)
                    assert all(reason in REJECTION_REASONS for _, reason in res.rejected)
                    _check_bank(bank)
            finally:
                bank.close()
    run()


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_parsed_replies_apply_cleanly(kind):
    """The real path: extractor text -> parser -> bank, with ids of entries that exist and do not."""
    @BANK_FUZZ
    @given(st.lists(model_text, min_size=1, max_size=5))
    def run(replies):
        with tempfile.TemporaryDirectory() as d:
            bank = _bank(Path(d), kind)
            try:
                bank.apply([Operation("ADD", f"seed {i}", f"lesson {i}") for i in range(3)], env_id="e", step=0,
                           extraction_id="seed", extractor_version=0)
                for step, text in enumerate(replies, 1):
                    for res in (parse_operations("<ops>\n<op>" + text), parse_json_operations(text, [1, 2, 3])):
                        bank.apply(res.ops, env_id="e", step=step, extraction_id=f"x{step}", extractor_version=0)
                        _check_bank(bank)
            finally:
                bank.close()
    run()
