"""ruff (configured in pyproject.toml: pycodestyle, pyflakes, import order, bugbear, blind excepts,
pyupgrade, and no unused ``noqa``; every ``noqa`` left says why) passes on the whole repository, and
the layers import as docs/architecture.md states: ``envs/`` and ``crl_bench/experience/`` never import
``trainer/``; no ``crl_bench/`` module but the commands, ``sweep`` and ``bench/`` imports ``trainer/``;
``env_api`` imports nothing of the project; no import circle anywhere (imports inside functions
count: a circle is a circle whether Python resolves it at import time or later)."""

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
        if parts[0] in {"build", "results"} or any(part == ".venv" or part.startswith(".") for part in parts):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "# noqa" in line and " - " not in line.split("# noqa", 1)[1]:
                bare.append(f"{path.relative_to(REPO)}:{n}")
    assert not bare, bare


# where each top-level folder of the checkout is installed (pyproject.toml [tool.setuptools.package-dir])
INSTALLED_AS = {"crl_bench": "crl_bench", "trainer": "crl_bench.trainer", "envs": "crl_bench.envs",
                "baselines": "crl_bench.baselines"}
# the modules of crl_bench/ (outside trainer/) that may import the trainer: the CLI's entry points
MAY_IMPORT_TRAINER = ("crl_bench.commands", "crl_bench.sweep", "crl_bench.bench")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[0] = INSTALLED_AS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    """``{module: [(line, imported project module), ...]}`` for every ``.py`` file under the folders of
    :data:`INSTALLED_AS` in ``root``, by installed module name. Every import counts, at any depth
    (function-level imports included); ``from a import b`` is an edge to ``a.b`` when that is a
    module of the project, else to ``a``; relative imports are resolved against the package."""
    files = {_module_name(root, p): p for top in INSTALLED_AS for p in sorted((root / top).rglob("*.py"))
             if "__pycache__" not in p.parts}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, list[tuple[int, str]]] = {}
    for mod, path in files.items():
        package = mod if mod in packages else mod.rpartition(".")[0]
        edges = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:          # ``import a.b.c`` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    edges.append((node.lineno, target))
        graph[mod] = edges
    return graph


def _is_trainer(mod: str) -> bool:
    return mod == "crl_bench.trainer" or mod.startswith("crl_bench.trainer.")


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def layer_violations(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Each import that breaks a layer rule of docs/architecture.md, as ``"module:line -> module (rule)"``."""
    bad = []
    for mod, edges in graph.items():
        for line, target in edges:
            if _is_trainer(target) and (_under(mod, "crl_bench.envs") or _under(mod, "crl_bench.experience")):
                bad.append(f"{mod}:{line} -> {target} (envs/ and experience/ never import trainer/)")
            elif (_is_trainer(target) and not _is_trainer(mod)
                  and not any(_under(mod, allowed) for allowed in MAY_IMPORT_TRAINER)):
                bad.append(f"{mod}:{line} -> {target} (only the CLI's commands, sweep and bench/ import trainer/)")
            if mod == "crl_bench.env_api":
                bad.append(f"{mod}:{line} -> {target} (env_api imports nothing of the project)")
    return bad


def import_circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm), each sorted; empty when every arrow points one way."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for _, w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_import_downwards_only():
    graph = import_graph(REPO)
    assert len(graph) > 80 and "crl_bench.trainer.loop" in graph and "crl_bench.envs.sokoban" in graph
    assert any(target == "crl_bench.trainer.loop" for _, target in graph["crl_bench.trainer.lifecycle"])
    assert layer_violations(graph) == []


def test_no_import_circle():
    assert import_circles(import_graph(REPO)) == []


@pytest.mark.parametrize("module, line, rule", [
    ("crl_bench/results/summary.py", "from crl_bench.trainer.loop import Trainer", "only the CLI"),
    ("envs/sokoban.py", "import crl_bench.trainer.policy", "never import trainer/"),
    ("crl_bench/experience/bank.py", "from crl_bench.trainer import losses", "never import trainer/"),
    ("crl_bench/env_api.py", "from crl_bench.data import sha256_file", "env_api imports nothing"),
])
def test_a_planted_upward_import_is_caught(tmp_path, module, line, rule):
    """The rules run on a copy of the checkout with one import planted inside a function."""
    for top in INSTALLED_AS:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _planted():\n    {line}\n", encoding="utf-8")
    bad = layer_violations(import_graph(tmp_path))
    assert len(bad) == 1 and rule in bad[0], bad


def test_a_planted_circle_is_caught(tmp_path):
    for top in INSTALLED_AS:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    policy = tmp_path / "trainer" / "policy.py"
    policy.write_text(policy.read_text(encoding="utf-8") + "\n\ndef _planted():\n    from . import loop\n",
                      encoding="utf-8")
    circles = import_circles(import_graph(tmp_path))
    assert circles and any({"crl_bench.trainer.policy", "crl_bench.trainer.loop"} <= set(c) for c in circles)
