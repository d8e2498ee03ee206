"""crl_bench.llm.lean_imports: the processes crl-bench owns load transformers' model classes without
scikit-learn; other programs keep transformers as it is."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("sklearn")          # installed with sentence-transformers; the case this is about


def _last_line(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split()        # the check's line, after anything printed before


def test_the_cli_loads_a_model_class_without_scikit_learn():
    """main() installs it before it parses the command line, for the rest of its process."""
    code = ("import sys\nfrom crl_bench.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n"
            "    pass\nimport transformers.models.llama.modeling_llama\n"
            "from transformers.utils import is_sklearn_available\n"
            "print('sklearn' in sys.modules, is_sklearn_available())\n")
    assert _last_line(code) == ["False", "False"]


def test_a_program_that_imports_crl_bench_keeps_transformers_as_it_is():
    code = ("import sys\nimport crl_bench.cli, crl_bench.trainer.data_parallel\n"
            "from crl_bench.llm import lean_imports\n"
            "print(any(isinstance(f, lean_imports._Finder) for f in sys.meta_path))\n")
    assert _last_line(code) == ["False"]


def test_install_after_transformers_generation_loaded_changes_nothing():
    import transformers.generation.candidate_generator  # noqa: F401 - loaded, as in a program that generated

    from crl_bench.llm import lean_imports

    assert lean_imports.install() is False
