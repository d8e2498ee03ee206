"""ruff (configured in pyproject.toml: pycodestyle, pyflakes, import order, bugbear, blind excepts,
pyupgrade, and no unused ``noqa``; every ``noqa`` left says why) passes on the whole repository, and
the layers import in one direction (CONTRIBUTING.md: ``envs/`` and ``experience/`` know nothing of
``trainer/``)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                        capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: it is part of the [test] extra (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                       text=True, cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_every_noqa_says_why():
    bare = []
    for path in REPO.glob("**/*.py"):
        parts = path.relative_to(REPO).parts
        if parts[0] == "results" or any(part in {".venv", "build"} or part.startswith(".") for part in parts):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "# noqa" in line and " - " not in line.split("# noqa", 1)[1]:
                bare.append(f"{path.relative_to(REPO)}:{n}")
    assert not bare, bare


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, at any depth (function-level imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_envs_and_experience_do_not_import_the_trainer():
    files = sorted((REPO / "envs").rglob("*.py")) + sorted((REPO / "crl_bench" / "experience").rglob("*.py"))
    assert len(files) > 10
    bad = [f"{path.relative_to(REPO)}:{n}: {mod}" for path in files for n, mod in _imported_modules(path)
           if mod == "crl_bench.trainer" or mod.startswith("crl_bench.trainer.") or mod.split(".")[0] == "trainer"]
    assert not bad, bad
