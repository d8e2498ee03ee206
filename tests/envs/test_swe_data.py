"""SWE-bench data: instance loading (parquet / jsonl / json), task lists, and
``crl-bench data download swebench`` (against a local HTTP server and a local source file).

The real data set comes from the data dir (``$CRL_BENCH_DATA``, ../shared/data in CI, set by conftest.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tests_helpers import FolderServer

from crl_bench.cli import main
from crl_bench.data import ChecksumError, DataMissingError, dataset_names, downloader, load_manifest
from crl_bench.envs.swebench import instances as inst_mod
from crl_bench.envs.swebench.instances import (
    VERIFIED_FILE,
    SWEInstance,
    default_instances_path,
    download_swebench,
    load_instances,
    load_task_list,
    select_instances,
)

KNOWN = "astropy__astropy-12907"


@pytest.fixture(scope="module")
def real_path() -> Path:
    p = default_instances_path()
    assert p.is_file(), f"the SWE-bench data set is expected at {p} (CRL_BENCH_DATA)"
    return p


@pytest.fixture(scope="module")
def real(real_path) -> list[SWEInstance]:
    return load_instances()          # the module's default path, from $CRL_BENCH_DATA


@pytest.fixture(scope="module")
def real_rows(real_path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(real_path).to_pylist()


# ---- load_instances on the real file ---------------------------------------------------------------

def test_default_path_is_in_the_data_dir(real_path, tmp_path):
    assert real_path.name == VERIFIED_FILE and real_path.parent.name == "swebench"
    assert default_instances_path(tmp_path) == tmp_path / "swebench" / VERIFIED_FILE


def test_real_file_has_500_unique_instances(real, real_path):
    man = load_manifest("swebench")["verified"]
    assert len(real) == 500 == man["instances"]
    ids = [i.instance_id for i in real]
    assert len(set(ids)) == 500
    assert all(isinstance(i, SWEInstance) for i in real)
    # the same file through an explicit path and through the data-dir override
    assert [i.instance_id for i in load_instances(real_path)] == ids
    assert [i.instance_id for i in load_instances(data_dir_override=real_path.parent.parent)] == ids


def test_real_test_lists_are_tuples_of_str_parsed_from_json(real, real_rows):
    by_row = {r["instance_id"]: r for r in real_rows}
    for inst in real:
        for attr, col in (("fail_to_pass", "FAIL_TO_PASS"), ("pass_to_pass", "PASS_TO_PASS")):
            v = getattr(inst, attr)
            assert isinstance(v, tuple) and all(isinstance(t, str) for t in v), (inst.instance_id, attr)
            assert list(v) == json.loads(by_row[inst.instance_id][col])
        assert inst.fail_to_pass, inst.instance_id          # every Verified instance has a failing test
        assert inst.eval_script and inst.log_parser and inst.image and inst.repo and inst.base_commit
    assert any(not i.pass_to_pass for i in real)            # some have an empty PASS_TO_PASS ("[]")


def test_known_instance(real):
    inst = next(i for i in real if i.instance_id == KNOWN)
    assert inst.repo == "astropy/astropy"
    assert inst.log_parser == "parse_log_astropy"
    assert inst.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert inst.base_commit == "d16bfe05a744909de4b27f5875fe0d4ed41ce607"
    assert inst.version == "4.3" and inst.eval_type == "pass_and_fail"
    assert len(inst.fail_to_pass) == 2
    assert all(t.startswith("astropy/modeling/tests/test_separable.py::") for t in inst.fail_to_pass)
    assert inst.pass_to_pass and "astropy/modeling/tests/test_separable.py::test_cdot" in inst.pass_to_pass
    assert inst.patch.startswith("diff --git a/astropy/modeling/separable.py")
    assert inst.test_patch.startswith("diff --git a/astropy/modeling/tests/test_separable.py")
    assert "separability_matrix" in inst.problem_statement


def test_row_keeps_the_original_columns(real, real_rows):
    inst = next(i for i in real if i.instance_id == KNOWN)
    orig = next(r for r in real_rows if r["instance_id"] == KNOWN)
    assert inst.row == orig
    assert isinstance(inst.row["FAIL_TO_PASS"], str)        # still the JSON string, not the list
    assert json.loads(inst.row["FAIL_TO_PASS"]) == list(inst.fail_to_pass)
    assert inst.row["environment_setup_commit"] == "298ccb478e6bf092953bca67a3d29dc6c35f6752"
    assert inst.row is not orig                              # a copy, not the caller's dict


# ---- other file types and malformed rows -------------------------------------------------------------

def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_and_json_inputs(real_rows, tmp_path):
    rows = real_rows[:3]
    want = [r["instance_id"] for r in rows]
    p = tmp_path / "some.jsonl"
    p.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n",
                 encoding="utf-8")                           # a blank line is skipped
    got = load_instances(p)
    assert [i.instance_id for i in got] == want
    assert got[0].fail_to_pass == tuple(json.loads(rows[0]["FAIL_TO_PASS"]))
    q = tmp_path / "some.json"
    q.write_text(json.dumps(rows), encoding="utf-8")
    got_json = load_instances(q)
    assert got_json == got                                   # same fields (row is not compared)
    assert got_json[1].row == rows[1]


def test_test_lists_may_be_lists_or_json_strings(real_rows, tmp_path):
    a, b = dict(real_rows[0]), dict(real_rows[1])
    a["FAIL_TO_PASS"] = json.loads(a["FAIL_TO_PASS"])       # a real list
    a["PASS_TO_PASS"] = []
    p = _write_jsonl(tmp_path / "mixed.jsonl", [a, b])
    got = load_instances(p)
    assert got[0].fail_to_pass == tuple(a["FAIL_TO_PASS"]) and got[0].pass_to_pass == ()
    assert got[1].fail_to_pass == tuple(json.loads(b["FAIL_TO_PASS"]))
    inst = SWEInstance.from_row(a)
    assert inst.fail_to_pass == tuple(a["FAIL_TO_PASS"]) and isinstance(inst.fail_to_pass, tuple)


def test_optional_columns_default(real_rows):
    row = {k: real_rows[0][k] for k in inst_mod.REQUIRED_COLUMNS}
    inst = SWEInstance.from_row(row)
    assert (inst.hints_text, inst.version, inst.eval_type, inst.patch, inst.test_patch) == \
        ("", "", "pass_and_fail", "", "")


@pytest.mark.parametrize("col", ["eval_script", "image", "FAIL_TO_PASS"])
def test_missing_required_column_names_column_and_instance(real_rows, tmp_path, col):
    rows = [dict(real_rows[0]), dict(real_rows[1])]
    del rows[1][col]
    p = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=col) as ei:
        load_instances(p)
    assert rows[1]["instance_id"] in str(ei.value) and "missing" in str(ei.value)
    assert str(p) in str(ei.value)


def test_empty_required_value_counts_as_missing(real_rows):
    row = dict(real_rows[0], log_parser="")
    with pytest.raises(ValueError, match=f"instance {row['instance_id']}: missing column.*log_parser"):
        SWEInstance.from_row(row)


@pytest.mark.parametrize("value", ["not json", '"a string"', "[1, 2]", '{"a": 1}'])
def test_bad_test_list_is_rejected(real_rows, value):
    row = dict(real_rows[0], PASS_TO_PASS=value)
    with pytest.raises(ValueError, match=f"instance {row['instance_id']}: PASS_TO_PASS"):
        SWEInstance.from_row(row)


def test_duplicate_instance_id_is_rejected(real_rows, tmp_path):
    rows = [real_rows[0], real_rows[1], real_rows[0]]
    p = _write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(ValueError, match=f"{real_rows[0]['instance_id']} appears twice"):
        load_instances(p)


def test_unknown_suffix_is_rejected(real_rows, tmp_path):
    p = _write_jsonl(tmp_path / "rows.csv", real_rows[:1])
    with pytest.raises(ValueError, match="unknown instance file type '.csv'"):
        load_instances(p)


def test_bad_jsonl_line_names_the_line(real_rows, tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text(json.dumps(real_rows[0]) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not a JSON object"):
        load_instances(p)


def test_json_file_must_hold_a_list(real_rows, tmp_path):
    p = tmp_path / "obj.json"
    p.write_text(json.dumps(real_rows[0]), encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON list"):
        load_instances(p)


def test_missing_file_names_the_download_command(tmp_path):
    with pytest.raises(DataMissingError, match="crl-bench data download swebench"):
        load_instances(tmp_path / "nope.parquet")
    with pytest.raises(DataMissingError, match="crl-bench data download swebench") as ei:
        load_instances(data_dir_override=tmp_path)           # empty data dir: the default path
    assert str(tmp_path / "swebench" / VERIFIED_FILE) in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)


# ---- task lists ------------------------------------------------------------------------------------

def test_task_list_plain_lines(tmp_path):
    p = tmp_path / "tasks.txt"
    p.write_text("# kept by swe filter\n\nb__b-2\n  a__a-1   # trailing comment\n\n c__c-3\n# end\n",
                 encoding="utf-8")
    assert load_task_list(p) == ["b__b-2", "a__a-1", "c__c-3"]


def test_task_list_json_list_and_kept_object(tmp_path):
    p = tmp_path / "tasks.json"
    p.write_text(json.dumps(["x__x-1", "y__y-2"]), encoding="utf-8")
    assert load_task_list(p) == ["x__x-1", "y__y-2"]
    q = tmp_path / "filter.json"
    q.write_text(json.dumps({"kept": ["y__y-2", "x__x-1"], "dropped": {"z__z-3": "flaky"}}, indent=1),
                 encoding="utf-8")
    assert load_task_list(q) == ["y__y-2", "x__x-1"]
    r = tmp_path / "nokept.json"
    r.write_text(json.dumps({"dropped": ["x"]}), encoding="utf-8")
    with pytest.raises(ValueError, match="kept"):
        load_task_list(r)
    s = tmp_path / "ints.json"
    s.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON list of instance ids"):
        load_task_list(s)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "[]", '{"kept": []}'])
def test_empty_task_list_is_rejected(tmp_path, text):
    p = tmp_path / "empty.txt"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="no instance ids"):
        load_task_list(p)


@pytest.mark.parametrize("text", ["a__a-1\nb__b-2\na__a-1\n", '["a__a-1", "b__b-2", "a__a-1"]'])
def test_repeated_task_id_is_rejected(tmp_path, text):
    p = tmp_path / "rep.txt"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="repeated instance id.*a__a-1"):
        load_task_list(p)


def test_missing_task_list(tmp_path):
    with pytest.raises(DataMissingError, match="not found"):
        load_task_list(tmp_path / "absent.txt")


def test_select_instances_keeps_task_list_order(real):
    ids = [real[7].instance_id, KNOWN, real[499].instance_id, real[3].instance_id]
    got = select_instances(real, ids)
    assert [i.instance_id for i in got] == ids
    assert got[1] is next(i for i in real if i.instance_id == KNOWN)
    assert select_instances(real, []) == []


def test_select_instances_names_unknown_ids(real):
    with pytest.raises(KeyError, match=r"2 unknown instance\(s\): nope__nope-1, nope__nope-2") as ei:
        select_instances(real, [KNOWN, "nope__nope-1", "nope__nope-2"])
    assert KNOWN not in str(ei.value)


# ---- download: a local HTTP server with the real checksums ----------------------------------------

@pytest.fixture()
def serve(monkeypatch):
    """``serve(folder, name)``: start a server on ``folder`` and point the manifest's url at ``name``."""
    servers = []

    def start(folder: Path, name: str) -> FolderServer:
        s = FolderServer(folder)
        servers.append(s)
        man = json.loads(json.dumps(load_manifest("swebench")))
        man["verified"]["url"] = f"{s.url}/{name}"
        monkeypatch.setattr(inst_mod, "load_manifest", lambda n: man if n == "swebench" else load_manifest(n))
        return s

    yield start
    for s in servers:
        s.close()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_matches_the_real_file(real_path):
    man = load_manifest("swebench")["verified"]
    assert real_path.stat().st_size == man["size"]
    assert _sha256(real_path) == man["sha256"]


def test_download_from_server(real_path, tmp_path, serve):
    server = serve(real_path.parent, real_path.name)
    root = download_swebench(tmp_path / "data", progress=False)
    assert root == tmp_path / "data" / "swebench"
    dest = root / VERIFIED_FILE
    assert dest.is_file()
    assert _sha256(dest) == load_manifest("swebench")["verified"]["sha256"]
    assert server.requests == [f"/{real_path.name}"]
    assert sorted(p.name for p in root.iterdir()) == [VERIFIED_FILE]     # no .part left behind
    assert len(load_instances(dest)) == 500


def test_download_of_other_bytes_raises_and_leaves_nothing(real_path, tmp_path, serve):
    good = real_path.read_bytes()
    srv = tmp_path / "srv"
    srv.mkdir()
    (srv / "same_size.parquet").write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    (srv / "short.parquet").write_bytes(good[:1000])
    serve(srv, "same_size.parquet")
    with pytest.raises(ChecksumError, match="sha256"):
        download_swebench(tmp_path / "d1", progress=False)
    serve(srv, "short.parquet")
    with pytest.raises(ChecksumError, match="1000 bytes, expected"):
        download_swebench(tmp_path / "d2", progress=False)
    for d in ("d1", "d2"):
        folder = tmp_path / d / "swebench"
        assert not (folder / VERIFIED_FILE).exists()
        assert not folder.exists() or list(folder.iterdir()) == []


def test_download_from_local_source(real_path, tmp_path):
    root = download_swebench(tmp_path / "data", source=str(real_path), progress=False)
    dest = root / VERIFIED_FILE
    assert dest.is_file() and _sha256(dest) == _sha256(real_path)
    assert len(load_instances(dest)) == 500


def test_local_source_with_other_content_needs_no_verify(real_rows, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    mirror = tmp_path / "mirror.parquet"
    pq.write_table(pa.Table.from_pylist(real_rows[:2]), mirror)
    with pytest.raises(ChecksumError):
        download_swebench(tmp_path / "a", source=str(mirror), progress=False)
    assert not (tmp_path / "a" / "swebench" / VERIFIED_FILE).exists()
    root = download_swebench(tmp_path / "b", source=str(mirror), progress=False, verify=False)
    got = load_instances(root / VERIFIED_FILE)
    assert [i.instance_id for i in got] == [r["instance_id"] for r in real_rows[:2]]


def test_verified_file_is_not_downloaded_again(real_path, tmp_path, serve):
    dest = tmp_path / "data" / "swebench" / VERIFIED_FILE
    dest.parent.mkdir(parents=True)
    dest.write_bytes(real_path.read_bytes())
    mtime = dest.stat().st_mtime_ns
    server = serve(real_path.parent, real_path.name)
    assert download_swebench(tmp_path / "data", progress=False) == dest.parent
    assert server.requests == []                          # the server was not contacted
    assert dest.stat().st_mtime_ns == mtime


def test_a_corrupt_existing_file_is_replaced(real_path, tmp_path, serve):
    dest = tmp_path / "data" / "swebench" / VERIFIED_FILE
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"not the data set")
    server = serve(real_path.parent, real_path.name)
    download_swebench(tmp_path / "data", progress=False)
    assert server.requests == [f"/{real_path.name}"]
    assert _sha256(dest) == _sha256(real_path)


# ---- the CLI ---------------------------------------------------------------------------------------

def test_cli_data_download_swebench(real_path, tmp_path, capsys):
    assert "swebench" in dataset_names() and downloader("swebench") is inst_mod.download_swebench
    data = tmp_path / "data"
    rc = main(["data", "download", "swebench", "--data-dir", str(data), "--source", str(real_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert any("swebench" in line and "ready" in line for line in out.splitlines()), out
    assert str(data) in out
    assert _sha256(data / "swebench" / VERIFIED_FILE) == _sha256(real_path)


def test_cli_reports_a_checksum_error(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"x" * 100)
    rc = main(["data", "download", "swebench", "--data-dir", str(tmp_path / "data"), "--source", str(bad)])
    assert rc == 2
    assert "crl-bench: error:" in capsys.readouterr().err
    assert not (tmp_path / "data" / "swebench" / VERIFIED_FILE).exists()


@pytest.mark.parametrize("name,text", [("x.jsonl", "[1, 2]\n"), ("x.json", "[[1, 2]]")])
def test_rows_that_are_not_objects_are_rejected(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match="JSON object"):
        load_instances(p)


def test_task_list_with_broken_json_names_the_file(tmp_path):
    p = tmp_path / "ids.json"
    p.write_text('["a", ')
    with pytest.raises(ValueError, match="ids.json: not valid JSON"):
        load_task_list(p)


def test_unreadable_unverified_download_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(Exception):  # noqa: B017 - whatever pyarrow raises; the point is what is left on disk
        inst_mod.download_swebench(tmp_path / "data", source=str(bad), progress=False, verify=False)
    assert not any((tmp_path / "data" / "swebench").iterdir())
