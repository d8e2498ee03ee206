"""WebShop data: ``crl-bench data download webshop``, its verification, and its manifest.

The env reads three files from ``<data dir>/webshop/`` (:func:`crl_bench.envs.webshop.products.webshop_dir`),
the files of upstream's small (1,000 product) configuration. Where each comes from by default (the
first URL of each file in ``crl_bench/data_manifests/webshop.json``; the Google Drive ids are the ones
upstream's own ``setup.sh -d small`` fetches with gdown, princeton-nlp/WebShop @ 64fa2a5c):

* ``items_shuffle_1000.json`` (the products):
  https://raw.githubusercontent.com/WillDreamer/webshop-minimal/e6c869d6d9d64ff2a75d3c23df9257f28ed56ea6/webshop_minimal/data/small/items_shuffle_1000.json
  (git blob ``08dfda9a1c89``), else Google Drive id ``1EgHdxQ_YxqIQlvvq5iKlCrkEKR6-j0Ib``.
* ``items_ins_v2_1000.json`` (attributes and synthetic instructions):
  https://raw.githubusercontent.com/WillDreamer/webshop-minimal/e6c869d6d9d64ff2a75d3c23df9257f28ed56ea6/webshop_minimal/data/small/items_ins_v2_1000.json,
  else Google Drive id ``1IduG0xl544V_A_jv3tHXC0kyFi7PnyBu``.
* ``items_human_ins.json`` (human instructions): upstream's whole file,
  https://raw.githubusercontent.com/princeton-nlp/WebShop/64fa2a5c15c7daa698b9ac93f5bb5437b634c9bd/baseline_models/data/items_human_ins.json
  (git blob ``b2ab7479b979``, the same blob as webshop-minimal's copy), else Google Drive id
  ``14Kb5SPBk_jfdLZ_CDBNitW98QLDlKR5O``. Only the records of the catalogue's products are kept (13 of
  them for the 1k catalogue), written as ``json.dumps({asin: records})`` in catalogue order.

How each file is verified before anything is put in place (all three are staged in a temporary
folder beside ``webshop/`` and moved there only when all three pass):

* ``items_ins_v2_1000.json``: size and sha256 of its bytes.
* ``items_shuffle_1000.json``: product by product. Each kept product (:func:`~.products.kept_products`)
  is cleaned as the env cleans it (:func:`~.products.clean_product`) and its
  :func:`~.products.product_digest` must equal the manifest's for that asin; the kept asins must be
  the manifest's, in the same order (the order fixes prices, goals and the search index), and the file
  must hold the manifest's number of entries. Raw bytes are not compared: the products file that
  crl-bench was checked against was rebuilt from the stored documents of a 1k search index, so only
  the cleaned content, which is what the env uses, is known to be upstream's.
* ``items_human_ins.json``: the kept subset, asin by asin (sha256 of each asin's records as canonical
  JSON), then the sha256 of the subset file as written.

A mismatch is a :class:`~crl_bench.data.ChecksumError` naming the file and the asin(s). When a file's
first source fails (unreachable, or not the verified content) the next one is tried.

``source=`` (``--source``) replaces every URL by one folder or base URL that holds the three files
under their own names (a copy of the data dir's ``webshop/``, or upstream's files): e.g.
``crl-bench data download webshop --source /mnt/copy/webshop`` or ``--source https://mirror/webshop``.

The manifest is regenerated from a folder of verified files with :func:`build_webshop_manifest`, or
``python -m crl_bench.envs.webshop.data DIR [--out FILE]`` (keeps the URLs of the shipped manifest).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import tempfile
import urllib.error
from collections.abc import Callable
from pathlib import Path

from crl_bench.data import ChecksumError, data_dir, download_url, folder_lock, load_manifest, local_source, sha256_file

from .products import ATTRIBUTES_FILE, HUMAN_FILE, PRODUCTS_FILE, clean_product, kept_products, product_digest

WEBSHOP_FILES = (PRODUCTS_FILE, ATTRIBUTES_FILE, HUMAN_FILE)
#: Most bytes read of one WebShop file whose manifest gives no size (upstream's whole human file is
#: the largest, tens of MB); a source that goes on is cut off there.
MAX_FILE_BYTES = 1 << 30

#: How many differing asins an error message lists before it only counts the rest.
_SHOWN = 5


def _shown(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _read_json(path: Path, what: type):
    """Parse ``path`` and check its top-level type; ValueError naming the file otherwise (also for a
    document nested too deeply for the parser)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path.name}: not a JSON file ({str(e)[:160]})") from None
    except RecursionError:
        raise ValueError(f"{path.name}: nested too deeply to be a WebShop file") from None
    if not isinstance(data, what):
        raise ValueError(f"{path.name}: expected a JSON {'list' if what is list else 'object'} at the top, "
                         f"got {type(data).__name__}")
    return data


def catalogue_digests(path: Path) -> tuple[int, dict[str, str]]:
    """``(number of entries, {asin: product_digest})`` of a products file, kept products in file order.

    Raises:
        ValueError: the file is not a JSON list of products, or a kept product lacks a field the
            catalogue needs or has a price it cannot read (the message names the asin and the file).
    """
    raw = _read_json(path, list)
    try:
        kept = kept_products(raw)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path.name}: an entry is not a product with an asin ({e!r})") from None
    out: dict[str, str] = {}
    for p in kept:
        try:
            out[p["asin"]] = product_digest(clean_product(p))
        except (KeyError, TypeError, AttributeError, IndexError, ArithmeticError) as e:
            raise ValueError(f"{path.name}: product {p['asin']} cannot be read as the catalogue reads it "
                             f"({e!r})") from None
    return len(raw), out


def verify_products(path: Path, expected: dict) -> list[str]:
    """Check a products file against the manifest entry ``expected`` (``{"entries": n, "products":
    {asin: digest}}`` in catalogue order); returns the kept asins in file order.

    Raises:
        ChecksumError: a product's cleaned content differs, a product is missing or extra, the order
            differs, or the number of entries differs (the message names the asins and the file).
        ValueError: the file cannot be read as a products file.
    """
    entries, got = catalogue_digests(path)
    want: dict[str, str] = expected["products"]
    name = path.name
    missing = [a for a in want if a not in got]
    extra = [a for a in got if a not in want]
    if missing or extra:
        parts = ([f"missing product(s) {_shown(missing)}"] if missing else []) + \
                ([f"extra product(s) {_shown(extra)}"] if extra else [])
        raise ChecksumError(f"{name}: {'; '.join(parts)} (against the {len(want)} products of the verified "
                            f"catalogue)")
    differ = [a for a in want if got[a] != want[a]]
    if differ:
        raise ChecksumError(f"{name}: product(s) {_shown(differ)} differ from the verified catalogue (the "
                            f"cleaned content the env uses has another sha256)")
    if list(got) != list(want):
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise ChecksumError(f"{name}: the products are in another order (position {first}: "
                            f"{list(got)[first]}, expected {list(want)[first]})")
    if entries != expected["entries"]:
        raise ChecksumError(f"{name}: {entries} entries, the verified file has {expected['entries']}")
    return list(got)


def _records_digest(records) -> str:
    text = json.dumps(records, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def human_subset(human: dict, asins: list[str]) -> dict:
    """The records of ``human`` (upstream's ``{asin: [records]}``) for the products ``asins``, in that
    order; asins without human instructions are left out."""
    return {a: human[a] for a in asins if a in human}


def verify_human(subset: dict, expected: dict, name: str = HUMAN_FILE) -> None:
    """Check the kept human records against the manifest entry ``expected`` (``{"asins": {asin:
    digest}}``).

    Raises:
        ChecksumError: an asin's records differ, or an asin is missing or extra (the message names them
            and the file).
    """
    want: dict[str, str] = expected["asins"]
    missing = [a for a in want if a not in subset]
    extra = [a for a in subset if a not in want]
    differ = [a for a in want if a in subset and _records_digest(subset[a]) != want[a]]
    parts = ([f"no records for {_shown(missing)}"] if missing else []) + \
            ([f"records for product(s) the verified file has none for: {_shown(extra)}"] if extra else []) + \
            ([f"the records of {_shown(differ)} differ from the verified ones"] if differ else [])
    if parts:
        raise ChecksumError(f"{name}: {'; '.join(parts)}")


def _write_subset(path: Path, subset: dict) -> None:
    path.write_text(json.dumps(subset), encoding="utf-8")


def _urls(man: dict, name: str, source: str | os.PathLike | None) -> list[str]:
    if source is None:
        return list(man["files"][name]["urls"])
    s = str(source)
    if "://" in s:
        return [s.rstrip("/") + "/" + name]
    folder = Path(s).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"webshop: --source {s} is neither a folder nor a URL")
    return [local_source(folder / name).resolve().as_uri()]


def _fetch(name: str, urls: list[str], dest: Path, check: Callable[[Path], None], expected_size: int | None,
           expected_sha256: str | None, progress: bool) -> None:
    """Download ``name`` from the first of ``urls`` that gives a file passing ``check``.

    Raises:
        the one error when there is one URL; else ChecksumError if some source gave other content,
        ValueError if some gave an unreadable file, urllib.error.URLError if none could be reached (a
        connection that breaks off is reported as URLError too).
    """
    errors: list[tuple[str, Exception]] = []
    for url in urls:
        try:
            try:
                download_url(url, dest, expected_size=expected_size, expected_sha256=expected_sha256,
                             progress=progress, max_bytes=MAX_FILE_BYTES)
            except (ConnectionError, TimeoutError, http.client.HTTPException) as e:
                raise urllib.error.URLError(f"{url}: {e!r}") from e
            check(dest)
            return
        except (urllib.error.URLError, ValueError, ChecksumError) as e:
            errors.append((url, e))
            if dest.exists():
                dest.unlink()
    if len(errors) == 1:
        raise errors[0][1]
    text = f"{name}: no source gave the verified file: " + "; ".join(f"{u}: {e}" for u, e in errors)
    if any(isinstance(e, ChecksumError) for _, e in errors):
        raise ChecksumError(text)
    if any(isinstance(e, ValueError) for _, e in errors):
        raise ValueError(text)
    raise urllib.error.URLError(text)


def _existing_ok(folder: Path, man: dict, verify: bool) -> bool:
    """Whether ``folder`` already holds the three files (verified against ``man`` when ``verify``)."""
    if not all((folder / n).is_file() for n in WEBSHOP_FILES):
        return False
    if not verify:
        return True
    files = man["files"]
    try:
        attrs = files[ATTRIBUTES_FILE]
        if sha256_file(folder / ATTRIBUTES_FILE) != attrs["sha256"]:
            return False
        verify_products(folder / PRODUCTS_FILE, files[PRODUCTS_FILE])
        return sha256_file(folder / HUMAN_FILE) == files[HUMAN_FILE]["sha256"]
    except (ChecksumError, ValueError):
        return False


def download_webshop(dest_root: Path | None = None, source: str | os.PathLike | None = None,
                     progress: bool = True, verify: bool = True) -> Path:
    """``crl-bench data download webshop``: the three WebShop files into ``<dest_root>/webshop``.

    Files already there that verify are kept without contacting any source. Otherwise all three are
    fetched (tqdm progress bars), verified as the module docstring says, and moved into place together.

    Args:
        dest_root: the data dir (default :func:`crl_bench.data.data_dir`).
        source: a folder or a base URL (``http(s)://``, ``file://``) holding ``items_shuffle_1000.json``,
            ``items_ins_v2_1000.json`` and ``items_human_ins.json`` (upstream's whole human file or the
            kept subset), used instead of the manifest's URLs.
        verify: check the files against ``crl_bench/data_manifests/webshop.json`` (off only for a trusted
            mirror whose content differs; the human file is still cut to the catalogue's products).

    Returns the ``webshop`` folder.

    Raises:
        ChecksumError: a file's content differs from the manifest (the message names the file and the
            asins); nothing is written to the data dir.
        ValueError: a fetched file is not the JSON it should be.
        FileNotFoundError: ``source`` is neither a folder nor a URL.
        urllib.error.URLError: no source of a file can be reached.
    """
    man = load_manifest("webshop")
    root = Path(dest_root) if dest_root is not None else data_dir()
    folder = root / "webshop"
    root.mkdir(parents=True, exist_ok=True)
    with folder_lock(root):
        for stale in root.glob(".webshop-download-*"):      # a download killed earlier
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        return _download_locked(root, folder, man, source, progress, verify)


def _download_locked(root: Path, folder: Path, man: dict, source: str | os.PathLike | None, progress: bool,
                     verify: bool) -> Path:
    if _existing_ok(folder, man, verify):
        return folder
    files = man["files"]
    urls = {n: _urls(man, n, source) for n in WEBSHOP_FILES}
    with tempfile.TemporaryDirectory(prefix=".webshop-download-", dir=root) as tmp:
        staged = Path(tmp)
        attrs = files[ATTRIBUTES_FILE]
        _fetch(ATTRIBUTES_FILE, urls[ATTRIBUTES_FILE], staged / ATTRIBUTES_FILE, lambda p: _read_json(p, dict),
               attrs["size"] if verify else None, attrs["sha256"] if verify else None, progress)

        asins: list[str] = []

        def check_products(path: Path) -> None:
            nonlocal asins
            if verify:
                asins = verify_products(path, files[PRODUCTS_FILE])
            else:
                asins = list(catalogue_digests(path)[1])

        _fetch(PRODUCTS_FILE, urls[PRODUCTS_FILE], staged / PRODUCTS_FILE, check_products, None, None, progress)

        full = staged / "upstream" / HUMAN_FILE          # the whole file, cut to the catalogue below

        def check_human(path: Path) -> None:
            subset = human_subset(_read_json(path, dict), asins)
            if verify:
                verify_human(subset, files[HUMAN_FILE])
            _write_subset(staged / HUMAN_FILE, subset)
            if verify and sha256_file(staged / HUMAN_FILE) != files[HUMAN_FILE]["sha256"]:
                raise ChecksumError(f"{HUMAN_FILE}: the kept records as written have sha256 "
                                    f"{sha256_file(staged / HUMAN_FILE)}, expected {files[HUMAN_FILE]['sha256']}")

        _fetch(HUMAN_FILE, urls[HUMAN_FILE], full, check_human, None, None, progress)
        full.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        for n in WEBSHOP_FILES:
            os.replace(staged / n, folder / n)
    return folder


def build_webshop_manifest(folder: Path, out: Path | None = None, urls: dict | None = None) -> dict:
    """Maintainers' tool: the WebShop manifest from a folder of verified files (a data dir's
    ``webshop/``), written to ``out`` when given.

    ``urls`` is ``{file name: {"urls": [...], "source": "..."}}``; by default the URLs and source notes of
    the shipped manifest are kept. The human file in ``folder`` may be upstream's whole file or the kept
    subset: the manifest describes the subset of the catalogue's products.

    Raises:
        ValueError: a file cannot be read. FileNotFoundError: a file is absent.
    """
    folder = Path(folder)
    if urls is None:
        urls = {n: {k: v for k, v in meta.items() if k in ("urls", "source")}
                for n, meta in load_manifest("webshop")["files"].items()}
    entries, digests = catalogue_digests(folder / PRODUCTS_FILE)
    subset = human_subset(_read_json(folder / HUMAN_FILE, dict), list(digests))
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / HUMAN_FILE
        _write_subset(written, subset)
        human_sha = sha256_file(written)
    attrs = folder / ATTRIBUTES_FILE
    _read_json(attrs, dict)
    man = {"files": {
        PRODUCTS_FILE: {**urls[PRODUCTS_FILE], "entries": entries, "products": digests},
        ATTRIBUTES_FILE: {**urls[ATTRIBUTES_FILE], "size": attrs.stat().st_size,
                          "sha256": sha256_file(attrs)},
        HUMAN_FILE: {**urls[HUMAN_FILE], "sha256": human_sha,
                     "asins": {a: _records_digest(r) for a, r in subset.items()}},
    }}
    if out is not None:
        Path(out).write_text(json.dumps(man, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return man


def main(argv: list[str] | None = None) -> int:
    """``python -m crl_bench.envs.webshop.data DIR [--out FILE]``: print or write the manifest of DIR."""
    ap = argparse.ArgumentParser(prog="python -m crl_bench.envs.webshop.data",
                                 description="regenerate crl_bench/data_manifests/webshop.json from verified files")
    ap.add_argument("folder", help="a folder holding the three WebShop files (a data dir's webshop/)")
    ap.add_argument("--out", help="write the manifest here (default: print it)")
    args = ap.parse_args(argv)
    man = build_webshop_manifest(Path(args.folder), Path(args.out) if args.out else None)
    if not args.out:
        print(json.dumps(man, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
