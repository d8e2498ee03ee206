"""A synthetic SWE-bench-shaped task, built by the tests: a tiny git repo with a bug, its test patch,
FAIL_TO_PASS / PASS_TO_PASS lists, an eval script in swebench's log format (the markers swebench's
grader reads, pytest ``-rA`` output for ``parse_log_pytest``) and an instance image built ``FROM`` the
local Debian base image (no registry involved)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from crl_bench.envs.swebench.engine import docker_client
from crl_bench.envs.swebench.images import BASE_IMAGE, build_base_image, image_present

TASK_IMAGE = "crl-bench/swe-synthetic:calc-v1"
INSTANCE_ID = "crl__calc-1"
SOURCE = '''"""Tiny calculator."""


def add(a, b):
    """Sum of a and b."""
    return a - b


def mul(a, b):
    """Product of a and b."""
    return a * b
'''
TESTS = '''from calc import add, mul


def test_mul():
    assert mul(3, 4) == 12
'''
TESTS_AFTER = TESTS + '''

def test_add():
    assert add(2, 3) == 5
'''
GOLD = ("diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n+++ b/calc/__init__.py\n"
        "@@ -3,7 +3,7 @@\n \n def add(a, b):\n     \"\"\"Sum of a and b.\"\"\"\n-    return a - b\n"
        "+    return a + b\n \n \n def mul(a, b):\n")


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def _test_patch() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp, "a.py"), Path(tmp, "b.py")
        a.write_text(TESTS)
        b.write_text(TESTS_AFTER)
        out = subprocess.run(["diff", "-u", "--label", "a/tests/test_calc.py", "--label", "b/tests/test_calc.py",
                              str(a), str(b)], capture_output=True, text=True).stdout
    return "diff --git a/tests/test_calc.py b/tests/test_calc.py\n" + out


def eval_script(base: str, test_patch: str) -> str:
    """The eval script, shaped as SWE-bench Verified's (reset test files, apply the test patch, run the
    tests between the output markers, reset again)."""
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed",
        "git config --global --add safe.directory /testbed", "git status",
        f"git -c core.fileMode=false diff {base}",
        f"git checkout {base} tests/test_calc.py",
        "git apply -v - <<'EOF_114329324912'", test_patch.rstrip("\n"), "EOF_114329324912",
        ": '>>>>> Start Test Output'",
        "python3 -m pytest -rA -p no:cacheprovider tests/test_calc.py",
        ": '>>>>> End Test Output'",
        f"git checkout {base} tests/test_calc.py", ""])


def build_task(workdir: Path, client=None) -> Path:
    """Build the base image (once per daemon) and the task image; write ``instances.jsonl`` in
    ``workdir`` and return its path."""
    client = client or docker_client(timeout=600)
    build_base_image(client=client)
    ctx = workdir / "ctx"
    repo = ctx / "testbed"
    (repo / "calc").mkdir(parents=True, exist_ok=True)
    (repo / "tests").mkdir(exist_ok=True)
    (repo / "calc" / "__init__.py").write_text(SOURCE)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / ".gitignore").write_text("__pycache__/\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "calc")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (ctx / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nCOPY testbed /testbed\nWORKDIR /testbed\n")
    if not image_present(client, TASK_IMAGE):
        client.images.build(path=str(ctx), tag=TASK_IMAGE, rm=True, pull=False)
    tp = _test_patch()
    row = {"repo": "crl/calc", "instance_id": INSTANCE_ID, "base_commit": base, "patch": GOLD,
           "test_patch": tp, "problem_statement": "add(2, 3) returns -1 instead of 5: calc.add subtracts.",
           "hints_text": "", "created_at": "2024-01-01T00:00:00Z", "version": "1.0",
           "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
           "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_mul"]),
           "environment_setup_commit": base, "eval_script": eval_script(base, tp),
           "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail", "image": TASK_IMAGE}
    path = workdir / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path
