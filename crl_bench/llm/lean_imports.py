"""Start-up of the processes crl-bench owns: transformers without its optional scikit-learn import.

When its generation package loads (every model class imports it), transformers imports
``sklearn.metrics`` if scikit-learn is installed (``transformers/generation/candidate_generator.py``,
guarded by ``transformers.utils.import_utils.is_sklearn_available``), and through it scipy.stats and
pandas. It needs them only to calibrate assisted decoding's confidence threshold (``roc_curve``), which
crl-bench never uses; scikit-learn is installed here only because sentence-transformers requires it.
That import is a third of the CPU time of importing a model class: measured 2026-11-30 on a 2-core
Intel Xeon with AMX beside other work, ``import transformers.models.llama.modeling_llama`` took 10.9-11.7 s
of user CPU as shipped and 7.7-8.5 s without scikit-learn, three interleaved runs each. Every process
that loads a model pays it: the CLI, each data-parallel rank, every cell of a sweep.

:func:`install` makes transformers see no scikit-learn from the moment its ``import_utils`` module
loads, in this process only. Only processes whose whole code crl-bench runs call it (the CLI's
:func:`~crl_bench.cli.main`, the data-parallel ranks, the Ray engine and manager actors, the test
session); a user's program that imports crl-bench as a library keeps transformers as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "transformers.utils.import_utils"


def _absent() -> bool:
    return False


def _patch(module: Any) -> None:
    if hasattr(module, "is_sklearn_available"):
        module.is_sklearn_available = _absent
    utils = sys.modules.get("transformers.utils")
    if utils is not None and hasattr(utils, "is_sklearn_available"):
        utils.is_sklearn_available = _absent


class _Loader(importlib.abc.Loader):
    """The real loader of ``transformers.utils.import_utils``, then :func:`_patch`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` through the other finders and wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Make transformers see no scikit-learn in this process; returns whether it takes effect.

    Takes effect when transformers' generation package has not been imported yet (else scikit-learn,
    if installed, is already loaded, and nothing changes). Idempotent."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return False
    loaded = sys.modules.get(_TARGET)
    if loaded is not None:
        _patch(loaded)
        return True
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
