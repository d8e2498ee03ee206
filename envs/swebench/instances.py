"""SWE-bench instances: loading (parquet / jsonl), task lists, and the data set's download.

An instance is one row of SWE-bench in the swebench 5.x format (``SWE-bench/SWE-bench``,
``data/SWE-bench_Verified/test.parquet``): the repository and commit, the issue text, the gold and test
patches, the ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` test lists (JSON strings there, lists here), the
``eval_script`` that runs the tests in the instance's container, the name of the ``log_parser`` that
reads its output (a key of ``swebench.harness.log_parsers.PARSER_REGISTRY``), ``eval_type`` and the
published ``image`` name.  The full row is kept in :attr:`SWEInstance.row` so that swebench's own
``make_test_spec`` can be built from it at grading time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crl_bench.data import (
    ChecksumError,
    DataMissingError,
    data_dir,
    download_url,
    folder_lock,
    load_manifest,
    local_source,
    remove_stale,
    sha256_file,
)

#: File name of SWE-bench Verified inside ``<data dir>/swebench``.
VERIFIED_FILE = "SWE-bench_Verified.parquet"
#: Columns every instance must have (the ones the env, the sandbox and the grader read).
REQUIRED_COLUMNS = ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS",
                    "PASS_TO_PASS", "eval_script", "log_parser", "image")


@dataclass(frozen=True)
class SWEInstance:
    """One SWE-bench task.

    Attributes:
        instance_id: e.g. ``"django__django-11099"``. repo: ``"owner/name"``. base_commit: the commit the
        agent starts from. problem_statement: the issue text shown to the agent. hints_text: issue
        comments (not shown by default). version: the repo version (picks the environment).
        fail_to_pass / pass_to_pass: test ids that must pass after the fix.  eval_script: bash script
        run in the container to test a candidate (resets and patches the test files, prints the test
        output between swebench's ``>>>>> Start Test Output`` / ``>>>>> End Test Output`` markers).
        log_parser: swebench parser name. eval_type: ``"pass_and_fail"`` or ``"fail_only"``.
        image: the published swebench image name. patch / test_patch: gold and test diffs.
        row: the original row (swebench's column names), for ``make_test_spec``.
    """

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    eval_script: str
    log_parser: str
    image: str
    hints_text: str = ""
    version: str = ""
    eval_type: str = "pass_and_fail"
    patch: str = ""
    test_patch: str = ""
    row: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_row(cls, row: dict[str, Any], where: str = "") -> SWEInstance:
        """Build from one data-set row; ``FAIL_TO_PASS``/``PASS_TO_PASS`` may be JSON strings or lists.

        Raises:
            ValueError: a required column is missing or a test list is not a list of strings
                (the message names the instance and the column).
        """
        iid = row.get("instance_id", "?")
        missing = [c for c in REQUIRED_COLUMNS if row.get(c) in (None, "") and c not in
                   ("FAIL_TO_PASS", "PASS_TO_PASS")]
        missing += [c for c in ("FAIL_TO_PASS", "PASS_TO_PASS") if row.get(c) is None]
        if missing:
            raise ValueError(f"{where}instance {iid}: missing column(s) {', '.join(missing)}")

        def tests(col: str) -> tuple[str, ...]:
            v = row[col]
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError:
                    raise ValueError(f"{where}instance {iid}: {col} is not JSON") from None
            if hasattr(v, "tolist"):            # numpy arrays from pyarrow/pandas
                v = v.tolist()
            if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
                raise ValueError(f"{where}instance {iid}: {col} must be a list of test ids")
            return tuple(v)

        return cls(instance_id=str(iid), repo=str(row["repo"]), base_commit=str(row["base_commit"]),
                   problem_statement=str(row["problem_statement"]),
                   fail_to_pass=tests("FAIL_TO_PASS"), pass_to_pass=tests("PASS_TO_PASS"),
                   eval_script=str(row["eval_script"]), log_parser=str(row["log_parser"]),
                   image=str(row["image"]), hints_text=str(row.get("hints_text") or ""),
                   version=str(row.get("version") or ""),
                   eval_type=str(row.get("eval_type") or "pass_and_fail"),
                   patch=str(row.get("patch") or ""), test_patch=str(row.get("test_patch") or ""),
                   row=dict(row))


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"{path}:{n}: not a JSON object")
                    rows.append(row)
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: expected a JSON list of instances, each a JSON object")
        return data
    raise ValueError(f"{path}: unknown instance file type {suffix!r} (use .parquet, .jsonl or .json)")


def default_instances_path(override: str | os.PathLike | None = None) -> Path:
    """``<data dir>/swebench/SWE-bench_Verified.parquet``."""
    return data_dir(override) / "swebench" / VERIFIED_FILE


def load_instances(path: str | os.PathLike | None = None,
                   data_dir_override: str | os.PathLike | None = None) -> list[SWEInstance]:
    """All instances of a data-set file, in file order.

    Args:
        path: a ``.parquet``, ``.jsonl`` or ``.json`` file in the swebench 5.x format; default
            :func:`default_instances_path`.
        data_dir_override: the data dir used for the default path.

    Raises:
        DataMissingError: the file does not exist (the message says how to get it).
        ValueError: a row lacks a required column, or two rows share an instance id.
    """
    p = Path(path) if path else default_instances_path(data_dir_override)
    if not p.is_file():
        raise DataMissingError(
            f"SWE-bench instances not found at {p}. Run `crl-bench data download swebench` (fetches "
            f"SWE-bench Verified into the data dir), point CRL_BENCH_DATA at a folder that has "
            f"swebench/{VERIFIED_FILE}, or set the env's `instances` to a parquet/jsonl file.")
    out = [SWEInstance.from_row(r, where=f"{p}: ") for r in _read_rows(p)]
    seen: set[str] = set()
    for inst in out:
        if inst.instance_id in seen:
            raise ValueError(f"{p}: instance {inst.instance_id} appears twice")
        seen.add(inst.instance_id)
    return out


def load_task_list(path: str | os.PathLike) -> list[str]:
    """Instance ids of a task-list file: one id per line (``#`` starts a comment, blank lines skipped),
    or a JSON list of ids, or the JSON object ``crl-bench swe filter`` writes (its ``"kept"`` list).

    Raises:
        DataMissingError: the file does not exist. ValueError: the file holds no ids or a repeated id.
    """
    p = Path(path)
    if not p.is_file():
        raise DataMissingError(f"task list {p} not found")
    text = p.read_text(encoding="utf-8")
    ids: list[str]
    if text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            data = data.get("kept")
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ValueError(f"{p}: expected a JSON list of instance ids (or an object with 'kept')")
        ids = list(data)
    else:
        ids = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        ids = [i for i in ids if i]
    if not ids:
        raise ValueError(f"{p}: no instance ids")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{p}: repeated instance id(s) {', '.join(dup[:5])}")
    return ids


def select_instances(instances: Sequence[SWEInstance], task_ids: Sequence[str]) -> list[SWEInstance]:
    """The instances named by ``task_ids``, in that order.

    Raises:
        KeyError: an id is not in ``instances`` (the message names up to five of them).
    """
    by_id = {i.instance_id: i for i in instances}
    unknown = [t for t in task_ids if t not in by_id]
    if unknown:
        raise KeyError(f"task list names {len(unknown)} unknown instance(s): {', '.join(unknown[:5])}")
    return [by_id[t] for t in task_ids]


def download_swebench(dest_root: Path | None = None, source: str | None = None, progress: bool = True,
                      verify: bool = True) -> Path:
    """``crl-bench data download swebench``: SWE-bench Verified (500 instances, swebench 5.x columns)
    into ``<data dir>/swebench/SWE-bench_Verified.parquet``.

    The source is the swebench repository's own copy (``SWE-bench/SWE-bench`` at the commit pinned in
    ``crl_bench/data_manifests/swebench.json``, ``data/SWE-bench_Verified/test.parquet``), checked
    against the manifest's size and sha256.

    Args:
        dest_root: the data dir (default :func:`crl_bench.data.data_dir`).
        source: a local parquet file to verify and copy instead of downloading.
        verify: check size and sha256 (off only for a trusted mirror whose file differs).

    Returns the ``swebench`` folder.

    Raises:
        ChecksumError: the file does not match the manifest (nothing is left in place).
        urllib.error.URLError: the source cannot be reached.
    """
    man = load_manifest("swebench")["verified"]
    root = (dest_root or data_dir()) / "swebench"
    url = local_source(source).resolve().as_uri() if source else man["url"]
    root.mkdir(parents=True, exist_ok=True)
    with folder_lock(root):
        remove_stale(root)                   # a download killed earlier: its .part and staged files
        dest = root / VERIFIED_FILE
        if dest.is_file() and (not verify or sha256_file(dest) == man["sha256"]):
            return root
        staged = root / (".staging-" + VERIFIED_FILE)
        download_url(url, staged, expected_size=man["size"] if verify else None,
                     expected_sha256=man["sha256"] if verify else None, progress=progress,
                     max_bytes=64 * man["size"])
        try:
            load_instances(staged)               # a readable data set, not only the right bytes
            os.replace(staged, dest)
        finally:
            if staged.exists():
                staged.unlink()
    return root


__all__ = ["SWEInstance", "load_instances", "load_task_list", "select_instances", "download_swebench",
           "default_instances_path", "ChecksumError", "DataMissingError"]
