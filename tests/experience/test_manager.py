"""The background experience manager's report: every processed extraction comes back, in order, with
what the bank made of its operations (the experience track credits and buffers from this report)."""

from __future__ import annotations

import uuid

import pytest

from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.extractor import EpisodeRecord, Extraction
from crl_bench.experience.lessons import MergeRequest
from crl_bench.experience.manager import DistillRequest, ExperienceManager, ExtractionOutcome
from crl_bench.experience.operations import parse_operations
from crl_bench.experience.retrieval import Retriever

ADD = "<ops>\n<op>ADD</op><title>Heads</title><content>Call heads.</content>\n</ops>"
NONE = "<ops>\n<op>NONE</op>\n</ops>"
GARBAGE = "banana split"
UNKNOWN = "<ops>\n<op>UPDATE 99</op><title>x</title><content>y</content>\n</ops>"   # parses; the bank refuses it
MERGE = "<ops>\n<op>MERGE {a} {b}</op><title>Heads</title><content>Heads wins.</content>\n</ops>"


class CannedExtractor:
    """Stands in for :class:`~crl_bench.experience.extractor.Extractor`: the next canned reply for each
    request, parsed in the line format without restricting ids (so the bank gets to refuse some)."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)

    def _sample(self, env_id: str, shown_ids: list[int]) -> Extraction:
        text = self.replies.pop(0)
        return Extraction(uuid.uuid4().hex, env_id, [1, 2], [3], [-1.0], text, parse_operations(text),
                          shown_ids=shown_ids)

    def extract(self, records, retrieved):
        return [self._sample(r.env_id, [e.id for e in shown]) for r, shown in zip(records, retrieved)]

    def extract_merges(self, groups):
        return [self._sample(g[0].env_id, [e.id for e in g]) for g in groups]


def _run(bank: ExperienceBank, replies: list[str], requests) -> list[ExtractionOutcome]:
    manager = ExperienceManager(bank, Retriever(bank), CannedExtractor(replies))
    try:
        manager.submit(requests)
        assert manager.drain(timeout=60)
        outcomes = manager.pop_outcomes()
        assert manager.pop_outcomes() == []                   # reported once
    finally:
        manager.close()
    return outcomes


def test_outcomes_report_what_the_bank_applied(tmp_path):
    bank = ExperienceBank(tmp_path / "bank.sqlite", HashEmbedder(32))
    replies = [ADD, NONE, GARBAGE, UNKNOWN]
    requests = [DistillRequest(EpisodeRecord("e", f"task {i}"), [], "e", step=1) for i in range(len(replies))]
    outcomes = _run(bank, replies, requests)
    assert all(isinstance(o, ExtractionOutcome) for o in outcomes)
    assert [o.extraction.text for o in outcomes] == replies                          # request order
    added, none, garbage, unknown = outcomes
    assert [op.kind for op, _ in added.applied.applied] == ["ADD"] and added.wrote and not added.said_none
    (entry,) = bank.entries()
    assert entry.source_extraction == added.extraction.id
    assert [op.kind for op, _ in none.applied.applied] == ["NONE"] and none.said_none and not none.wrote
    assert garbage.applied is None and not garbage.wrote and not garbage.said_none   # nothing reached the bank
    assert unknown.applied is not None and len(unknown.applied.rejected) == 1 and not unknown.applied.applied
    assert not unknown.wrote and not unknown.said_none
    bank.close()


def test_merge_outcome_reports_the_new_entry(tmp_path):
    bank = ExperienceBank(tmp_path / "bank.sqlite", HashEmbedder(32))
    first = _run(bank, [ADD, ADD.replace("Call heads.", "Say heads.")],
                 [DistillRequest(EpisodeRecord("e", f"task {i}"), [], "e", step=1) for i in range(2)])
    assert all(o.wrote for o in first)
    a, b = (e.id for e in bank.entries())
    (merged,) = _run(bank, [MERGE.format(a=a, b=b)], [MergeRequest(bank.get([a, b]), "e", step=2)])
    ((op, new_id),) = merged.applied.applied
    assert op.kind == "MERGE" and op.targets == (a, b) and merged.wrote
    assert [e.id for e in bank.entries()] == [new_id] and new_id not in (a, b)
    assert bank.entries()[0].source_extraction == merged.extraction.id
    bank.close()


def test_a_distillation_is_shown_the_live_bank_not_its_retrieval_snapshot(tmp_path):
    """Two episodes retrieved the same entry; the first one's distillation rewrites it (UPDATE). The
    second, distilled after that, is shown the bank as it is then: the rewritten entry is gone, so it
    is shown nothing, and its reply cannot name the old entry (released ``build_memory_model_messages``
    re-reads each retrieved uid and skips the missing). Entries still there are shown as they are now."""
    bank = ExperienceBank(tmp_path / "bank.sqlite", HashEmbedder(32))
    _run(bank, [ADD, ADD.replace("Heads", "Tails").replace("Call heads.", "Call tails.")],
         [DistillRequest(EpisodeRecord("e", f"task {i}"), [], "e", step=1) for i in range(2)])
    heads, tails = bank.entries()
    snapshot = [heads, tails]                      # what both episodes retrieved
    update = f"<ops>\n<op>UPDATE {heads.id}</op><title>Heads</title><content>Call heads twice.</content>\n</ops>"
    extractor = CannedExtractor([update, NONE])
    shown: list[list[int]] = []
    extract = extractor.extract

    def recording(records, retrieved):
        shown.extend([[e.id for e in r] for r in retrieved])
        return extract(records, retrieved)

    extractor.extract = recording
    manager = ExperienceManager(bank, Retriever(bank), extractor)
    try:
        for i in range(2):                         # one after the other, as two steps' distillations
            manager.submit([DistillRequest(EpisodeRecord("e", f"episode {i}"), list(snapshot), "e", step=2)])
            assert manager.drain(timeout=60)
    finally:
        manager.close()
    assert shown == [[heads.id, tails.id], [tails.id]]
    titles = sorted(e.title for e in bank.entries())
    assert titles == ["Heads", "Tails"] and len(bank.entries()) == 2     # no extra entry
    bank.close()


def test_the_embedder_runs_where_experience_embedder_device_says(monkeypatch, tmp_path):
    import torch

    from crl_bench.config import ConfigError, build_config
    from crl_bench.experience import embedding, manager

    assert build_config([]).experience.embedder_device == "cpu"
    with pytest.raises(ConfigError, match="experience.embedder_device"):
        build_config([{"experience": {"embedder_device": "gpu0"}}])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert manager.embedder_device("auto") == "cpu" and manager.embedder_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="embedder_device=cuda:1"):
        manager.embedder_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert manager.embedder_device("auto") == "cuda" and manager.embedder_device("cuda:1") == "cuda:1"
    seen = []

    class Recorded(embedding.HashEmbedder):
        def __init__(self, model, device="cpu", **kw):
            seen.append((model, device))
            super().__init__(64)

    monkeypatch.setattr(embedding, "SentenceEmbedder", Recorded)
    cfg = build_config([{"method": "casebank", "experience": {"embedder_device": "cuda:1"}}])
    manager.build_manager(cfg, tmp_path / "bank.sqlite", None, None, compute_dtype=torch.float32)
    assert seen == [(cfg.experience.embedder, "cuda:1")]
