"""``crl-bench data download webshop``: fetching (a local HTTP server and local folders stand in for the
public sources), verification against the shipped manifest, and the missing-data message.

The files served are copies of the data dir's ``webshop/`` (``$CRL_BENCH_DATA``, set by conftest.py),
checked with the real ``crl_bench/data_manifests/webshop.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from tests_helpers import FolderServer

from crl_bench.cli import main
from crl_bench.data import ChecksumError, DataMissingError, dataset_names, downloader, load_manifest
from crl_bench.envs.webshop import data as data_mod
from crl_bench.envs.webshop.data import build_webshop_manifest, download_webshop
from crl_bench.envs.webshop.products import (
    ATTRIBUTES_FILE,
    HUMAN_FILE,
    PRODUCTS_FILE,
    load_catalogue,
    webshop_dir,
)

FILES = (PRODUCTS_FILE, ATTRIBUTES_FILE, HUMAN_FILE)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def copy(tmp_path) -> Path:
    """A writable copy of the data dir's three WebShop files, to serve or to tamper with."""
    src = webshop_dir()
    dst = tmp_path / "srv"
    dst.mkdir()
    for n in FILES:
        shutil.copyfile(src / n, dst / n)
    return dst


@pytest.fixture()
def serve(monkeypatch):
    """``serve(folder)``: serve ``folder`` and point every URL of the manifest at it (``extra_first``:
    URLs tried before it)."""
    servers = []

    def start(folder: Path, extra_first: tuple[str, ...] = ()) -> FolderServer:
        s = FolderServer(folder)
        servers.append(s)
        man = json.loads(json.dumps(load_manifest("webshop")))
        for n, meta in man["files"].items():
            meta["urls"] = [*(f"{u}/{n}" for u in extra_first), f"{s.url}/{n}"]
        monkeypatch.setattr(data_mod, "load_manifest", lambda name: man if name == "webshop" else load_manifest(name))
        return s

    yield start
    for s in servers:
        s.close()


def _products(folder: Path) -> list[dict]:
    return json.loads((folder / PRODUCTS_FILE).read_text(encoding="utf-8"))


def _write_products(folder: Path, products: list[dict]) -> None:
    (folder / PRODUCTS_FILE).write_text(json.dumps(products), encoding="utf-8")


def _assert_nothing_written(root: Path) -> None:
    assert not root.exists() or list(root.iterdir()) == [], list(root.rglob("*"))


# ---- the manifest ---------------------------------------------------------------------------------

def test_manifest_is_what_the_offline_data_regenerates():
    man = load_manifest("webshop")
    assert build_webshop_manifest(webshop_dir()) == man
    files = man["files"]
    assert files[PRODUCTS_FILE]["entries"] == 1000 and len(files[PRODUCTS_FILE]["products"]) == 1000
    assert len(files[HUMAN_FILE]["asins"]) == 13
    assert _sha(webshop_dir() / ATTRIBUTES_FILE) == files[ATTRIBUTES_FILE]["sha256"]
    assert _sha(webshop_dir() / HUMAN_FILE) == files[HUMAN_FILE]["sha256"]
    for meta in files.values():            # a public source first, upstream's Google Drive id after it
        assert meta["urls"][0].startswith("https://raw.githubusercontent.com/")
        assert meta["urls"][-1].startswith("https://drive.google.com/")


def test_manifest_script_writes_the_same_file(tmp_path):
    out = tmp_path / "webshop.json"
    assert data_mod.main([str(webshop_dir()), "--out", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == load_manifest("webshop")


# ---- download --------------------------------------------------------------------------------------

def test_download_from_server_verifies_and_the_env_loads(copy, tmp_path, serve):
    server = serve(copy)
    root = download_webshop(tmp_path / "data", progress=False)
    assert root == tmp_path / "data" / "webshop"
    assert sorted(p.name for p in root.iterdir()) == sorted(FILES)      # nothing staged is left
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["webshop"]
    for n in FILES:
        assert _sha(root / n) == _sha(webshop_dir() / n)
        assert (root / n).stat().st_mode & 0o044 == 0o044 or os.umask(os.umask(0)) & 0o044  # readable by others
    assert sorted(server.requests) == sorted(f"/{n}" for n in FILES)
    cat = load_catalogue(tmp_path / "data", human_goals=True)
    assert len(cat.products) == 1000 and sum(p.human_instructions is not None for p in cat.products) == 13

    from crl_bench.envs.webshop.env import WebShopEnv

    env = WebShopEnv(data_dir=str(tmp_path / "data"))
    obs, _ = env.reset(options={"task": env.task_ids("eval")[0]})
    assert "search" in obs.lower()


def test_upstream_whole_human_file_is_cut_to_the_catalogue(copy, tmp_path, serve):
    human = json.loads((copy / HUMAN_FILE).read_text(encoding="utf-8"))
    whole = {"B000NOTSOLD": [{"asin": "B000NOTSOLD", "instruction": "not in the 1k catalogue"}]}
    whole.update(reversed(list(human.items())))           # upstream's order need not be the catalogue's
    (copy / HUMAN_FILE).write_text(json.dumps(whole), encoding="utf-8")
    serve(copy)
    root = download_webshop(tmp_path / "data", progress=False)
    assert _sha(root / HUMAN_FILE) == load_manifest("webshop")["files"][HUMAN_FILE]["sha256"]
    assert list(json.loads((root / HUMAN_FILE).read_text(encoding="utf-8"))) == list(human)


def test_source_folder_and_base_url(copy, tmp_path):
    root = download_webshop(tmp_path / "a", source=str(copy), progress=False)
    assert all(_sha(root / n) == _sha(webshop_dir() / n) for n in FILES)
    with FolderServer(copy.parent) as s:
        root = download_webshop(tmp_path / "b", source=f"{s.url}/{copy.name}/", progress=False)
    assert all(_sha(root / n) == _sha(webshop_dir() / n) for n in FILES)
    with pytest.raises(FileNotFoundError, match="neither a folder nor a URL"):
        download_webshop(tmp_path / "c", source=str(tmp_path / "nowhere"), progress=False)


def test_raw_differences_the_cleaning_removes_are_accepted(copy, tmp_path):
    products = _products(copy)
    products[0]["pricing"] = products[0]["pricing"] + "0"          # "$877.8" -> "$877.80": the same price
    products[0]["images"] = []                                     # a field the catalogue does not read
    products[1]["query"] = "  " + products[1]["query"].upper()     # the catalogue lowercases and strips it
    _write_products(copy, products)
    root = download_webshop(tmp_path / "data", source=str(copy), progress=False)
    assert _products(root)[0]["pricing"].endswith("0")


def test_a_changed_product_is_rejected_naming_it(copy, tmp_path, serve):
    products = _products(copy)
    asin = products[7]["asin"]
    products[7]["name"] += " (refurbished)"
    _write_products(copy, products)
    serve(copy)
    with pytest.raises(ChecksumError, match=rf"{PRODUCTS_FILE}: product\(s\) {asin} differ"):
        download_webshop(tmp_path / "data", progress=False)
    _assert_nothing_written(tmp_path / "data")


@pytest.mark.parametrize("change,message", [
    ("drop", "missing product"),
    ("add", "extra product"),
    ("swap", "another order"),
])
def test_a_missing_extra_or_moved_product_is_rejected(copy, tmp_path, change, message):
    products = _products(copy)
    named = products[3]["asin"]
    if change == "drop":
        del products[3]
    elif change == "add":
        named = "B0EXTRA001"
        products.append({**products[0], "asin": named})
    else:
        products[3], products[4] = products[4], products[3]
    _write_products(copy, products)
    with pytest.raises(ChecksumError, match=rf"{PRODUCTS_FILE}: .*{message}.*{named}"):
        download_webshop(tmp_path / "data", source=str(copy), progress=False)
    _assert_nothing_written(tmp_path / "data")


def test_one_changed_byte_of_the_attribute_file_is_rejected(copy, tmp_path, serve):
    raw = bytearray((copy / ATTRIBUTES_FILE).read_bytes())
    i = raw.index(b"tea tree")
    raw[i] = ord("T")
    (copy / ATTRIBUTES_FILE).write_bytes(bytes(raw))
    serve(copy)
    with pytest.raises(ChecksumError, match=rf"{ATTRIBUTES_FILE}: sha256"):
        download_webshop(tmp_path / "data", progress=False)
    _assert_nothing_written(tmp_path / "data")


def test_a_changed_human_record_is_rejected_naming_it(copy, tmp_path, serve):
    human = json.loads((copy / HUMAN_FILE).read_text(encoding="utf-8"))
    asin = list(human)[2]
    human[asin][0]["instruction"] += " and cheap"
    (copy / HUMAN_FILE).write_text(json.dumps(human), encoding="utf-8")
    serve(copy)
    with pytest.raises(ChecksumError, match=rf"{HUMAN_FILE}: the records of {asin} differ"):
        download_webshop(tmp_path / "data", progress=False)
    _assert_nothing_written(tmp_path / "data")


def test_no_verify_takes_a_trusted_mirror_as_it_is(copy, tmp_path):
    products = _products(copy)
    products[7]["name"] += " (refurbished)"
    _write_products(copy, products)
    root = download_webshop(tmp_path / "data", source=str(copy), progress=False, verify=False)
    assert _products(root)[7]["name"].endswith("(refurbished)")


def test_not_json_is_an_error_naming_the_file(copy, tmp_path):
    (copy / PRODUCTS_FILE).write_text("<html>quota exceeded</html>", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{PRODUCTS_FILE}: not a JSON file"):
        download_webshop(tmp_path / "data", source=str(copy), progress=False)
    _assert_nothing_written(tmp_path / "data")


def test_deep_json_is_one_line_exit_2_for_the_download_and_the_env(copy, tmp_path, capsys):
    """A products file nested 100,000 levels deep (RecursionError in the JSON parser): the download
    and the env's loader each report one line naming the file, not a traceback."""
    from crl_bench.data import DataInvalidError

    (copy / PRODUCTS_FILE).write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert main(["data", "download", "webshop", "--source", str(copy), "--data-dir", str(tmp_path / "d")]) == 2
    assert f"{PRODUCTS_FILE}: nested too deeply" in capsys.readouterr().err
    _assert_nothing_written(tmp_path / "d")
    with pytest.raises(DataInvalidError, match=f"{PRODUCTS_FILE}: nested too deeply.*data download webshop"):
        load_catalogue(copy)
    from crl_bench.cli import USER_ERRORS

    assert issubclass(DataInvalidError, USER_ERRORS)        # `crl-bench run` prints it as one line, exit 2


def test_the_next_source_is_tried_when_one_fails(copy, tmp_path, serve):
    (tmp_path / "empty").mkdir()
    with FolderServer(tmp_path / "empty") as dead:                 # answers 404 for every file
        serve(copy, extra_first=(dead.url,))
        root = download_webshop(tmp_path / "data", progress=False)
    assert all(_sha(root / n) == _sha(webshop_dir() / n) for n in FILES)


def test_verified_files_are_not_fetched_again_and_bad_ones_are_replaced(copy, tmp_path, serve):
    root = download_webshop(tmp_path / "data", source=str(copy), progress=False)
    server = serve(copy)
    assert download_webshop(tmp_path / "data", progress=False) == root
    assert server.requests == []
    (root / ATTRIBUTES_FILE).write_text("{}", encoding="utf-8")
    download_webshop(tmp_path / "data", progress=False)
    assert _sha(root / ATTRIBUTES_FILE) == _sha(webshop_dir() / ATTRIBUTES_FILE)
    assert server.requests


# ---- the command line and the missing-data message ------------------------------------------------

def test_cli_lists_and_downloads_webshop(copy, tmp_path, capsys):
    assert "webshop" in dataset_names() and downloader("webshop") is download_webshop
    assert main(["data", "list"]) == 0
    assert "webshop" in capsys.readouterr().out.split()
    data = tmp_path / "data"
    assert main(["data", "download", "webshop", "--data-dir", str(data), "--source", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "webshop: ready in" in out and str(data) in out
    assert all(_sha(data / "webshop" / n) == _sha(webshop_dir() / n) for n in FILES)


def test_cli_reports_a_tampered_file_and_an_unreachable_source(copy, tmp_path, capsys):
    products = _products(copy)
    products[0]["category"] = "toys"
    _write_products(copy, products)
    rc = main(["data", "download", "webshop", "--data-dir", str(tmp_path / "d1"), "--source", str(copy)])
    err = capsys.readouterr().err
    assert rc == 2 and "crl-bench: error:" in err and products[0]["asin"] in err
    _assert_nothing_written(tmp_path / "d1")
    rc = main(["data", "download", "webshop", "--data-dir", str(tmp_path / "d2"),
               "--source", "http://127.0.0.1:9/webshop"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be reached" in err and "--source" in err
    _assert_nothing_written(tmp_path / "d2")


def test_cli_source_takes_one_data_set(copy, tmp_path, capsys):
    rc = main(["data", "download", "alfworld", "webshop", "--data-dir", str(tmp_path), "--source", str(copy)])
    assert rc == 2 and "one data set" in capsys.readouterr().err


def test_missing_data_names_the_download_command(tmp_path, monkeypatch, capsys):
    with pytest.raises(DataMissingError) as ei:
        load_catalogue(tmp_path)
    msg = str(ei.value)
    assert "crl-bench data download webshop" in msg and "CI" not in msg and "shared" not in msg
    assert all(n in msg for n in FILES)
    monkeypatch.setenv("CRL_BENCH_DATA", str(tmp_path))
    assert main(["run", "--method", "grpo", "--mix", "webshop", "--preset", "smoke",
                 "--output-dir", str(tmp_path / "runs")]) == 2
    assert "crl-bench data download webshop" in capsys.readouterr().err
