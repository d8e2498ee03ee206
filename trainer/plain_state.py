"""Checkpoint state as plain data: what ``torch.load(..., weights_only=True)`` reads without running code.

A trainer's and an experience track's ``state_dict`` hold Python objects besides tensors: dataclasses
(episode specs, extractions, manager counters), NumPy arrays (the legacy global generator's key),
sets and enums.  Pickling them as they are makes ``torch.load`` import and call whatever a checkpoint
names, so a crafted ``trainer.pt`` would run code on ``--resume``.  :func:`encode` turns such a state
into a tree that only holds ``dict``, ``list``, ``tuple``, ``str``, ``bytes``, ``int``, ``float``,
``bool``, ``None`` and ``torch.Tensor`` (the types torch's weights-only unpickler accepts), tagging
each non-plain object with a one-key dict; :func:`decode` rebuilds it, creating objects only of the
kinds it knows:

* ``{"__dataclass__": "crl_bench.module:Class", "state": {...}}``: a dataclass defined in a
  ``crl_bench`` module; rebuilt like pickle does (``Class.__new__`` then its attributes set), so no
  ``__init__``/``__post_init__`` runs.  Any other class name is refused.
* ``{"__enum__": "crl_bench.module:Class", "value": v}``: a member of an ``Enum`` of ``crl_bench``.
* ``{"__ndarray__": [...], "dtype": "<u4", "shape": [...]}`` and ``{"__npscalar__": v, "dtype": ...}``:
  NumPy arrays and scalars (numeric dtypes only).
* ``{"__set__": [...]}``, ``{"__frozenset__": [...]}``; a dict whose keys include such a tag word is
  stored as ``{"__dict__": [[key, value], ...]}``.

Errors: :func:`encode` raises ``TypeError`` naming the path of a value it cannot store (so a save
fails loudly instead of writing what a resume cannot read); :func:`decode` raises
:class:`PlainStateError` (a ``ValueError``) naming the path of a tag it refuses.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
from typing import Any

import numpy as np
import torch

_TAGS = ("__dataclass__", "__enum__", "__ndarray__", "__npscalar__", "__set__", "__frozenset__", "__dict__")
_CLASS = re.compile(r"^crl_bench(\.[A-Za-z_][A-Za-z0-9_]*)+:[A-Za-z_][A-Za-z0-9_]*$")
_NUMERIC = "biufc?"        # NumPy dtype kinds: bool, signed, unsigned, float, complex (no objects)


class PlainStateError(ValueError):
    """A stored state holds something :func:`decode` does not rebuild (an unknown class, a bad tag)."""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(obj: Any, path: str = "$") -> Any:
    """``obj`` as plain data (module docstring).  Tensors are kept as they are (detached).

    Raises:
        TypeError: a value of a type that is not plain, not a ``crl_bench`` dataclass or enum and not
            a numeric NumPy value (the message names its path in ``obj``).
    """
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _NUMERIC:
            raise TypeError(f"{path}: a NumPy array of dtype {obj.dtype} cannot be stored as plain data")
        return {"__ndarray__": obj.ravel().tolist(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in _NUMERIC:
            raise TypeError(f"{path}: a NumPy value of dtype {obj.dtype} cannot be stored as plain data")
        return {"__npscalar__": obj.item(), "dtype": obj.dtype.str}
    if isinstance(obj, enum.Enum):
        _check_class(type(obj), path)
        return {"__enum__": _name(type(obj)), "value": encode(obj.value, f"{path}.value")}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _check_class(type(obj), path)
        attrs = (dict(vars(obj)) if hasattr(obj, "__dict__")
                 else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
        return {"__dataclass__": _name(type(obj)),
                "state": {k: encode(v, f"{path}.{k}") for k, v in attrs.items()}}
    if isinstance(obj, (set, frozenset)):
        tag = "__set__" if isinstance(obj, set) else "__frozenset__"
        return {tag: [encode(v, f"{path}{{}}") for v in sorted(obj, key=repr)]}
    if type(obj) is tuple:
        return tuple(encode(v, f"{path}[{i}]") for i, v in enumerate(obj))
    if type(obj) is list:
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict) and type(obj).__module__ in ("builtins", "collections"):
        items = [(encode(k, f"{path}.<key>"), encode(v, f"{path}.{k}")) for k, v in obj.items()]
        if any(isinstance(k, str) and k in _TAGS for k, _ in items) or any(
                not isinstance(k, (str, int, float, bool, type(None), tuple)) for k, _ in items):
            return {"__dict__": [[k, v] for k, v in items]}
        return dict(items)
    raise TypeError(f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a checkpoint "
                    f"as plain data")


def _check_class(cls: type, path: str) -> None:
    if not _CLASS.match(_name(cls)):
        raise TypeError(f"{path}: a {_name(cls)} cannot be stored in a checkpoint (only crl_bench "
                        f"dataclasses and enums are)")


def _load_class(name: Any, path: str, kind: str) -> type:
    if not isinstance(name, str) or not _CLASS.match(name):
        raise PlainStateError(f"{path}: {kind} {str(name)[:80]!r} is not a crl_bench class; refused")
    module, _, qual = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError):
        raise PlainStateError(f"{path}: {kind} {name!r} does not exist in this version") from None
    ok = (isinstance(cls, type) and dataclasses.is_dataclass(cls)) if kind == "dataclass" else \
        (isinstance(cls, type) and issubclass(cls, enum.Enum))
    if not ok:
        raise PlainStateError(f"{path}: {name!r} is not a {kind}; refused")
    return cls


def decode(obj: Any, path: str = "$") -> Any:
    """Rebuild what :func:`encode` stored.

    Raises:
        PlainStateError: a tag names a class that is not a ``crl_bench`` dataclass or enum, a
            non-numeric dtype, or is malformed (the message names its path).
    """
    if isinstance(obj, list):
        return [decode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(decode(v, f"{path}[{i}]") for i, v in enumerate(obj))
    if not isinstance(obj, dict):
        return obj
    tag = next((k for k in _TAGS if k in obj), None) if len(obj) <= 3 else None
    try:
        if tag == "__dataclass__":
            cls = _load_class(obj["__dataclass__"], path, "dataclass")
            state = obj["state"]
            if not isinstance(state, dict):
                raise PlainStateError(f"{path}: the state of {obj['__dataclass__']} is not a mapping")
            out = cls.__new__(cls)
            for k, v in state.items():
                if not isinstance(k, str):
                    raise PlainStateError(f"{path}: an attribute name that is not a string")
                object.__setattr__(out, k, decode(v, f"{path}.{k}"))
            return out
        if tag == "__enum__":
            return _load_class(obj["__enum__"], path, "enum")(decode(obj["value"], f"{path}.value"))
        if tag in ("__ndarray__", "__npscalar__"):
            dtype = np.dtype(str(obj["dtype"]))
            if dtype.kind not in _NUMERIC:
                raise PlainStateError(f"{path}: dtype {dtype} is not numeric; refused")
            if tag == "__npscalar__":
                return dtype.type(obj["__npscalar__"])
            return np.asarray(obj["__ndarray__"], dtype=dtype).reshape([int(n) for n in obj["shape"]])
        if tag in ("__set__", "__frozenset__"):
            items = [decode(v, f"{path}{{}}") for v in obj[tag]]
            return set(items) if tag == "__set__" else frozenset(items)
        if tag == "__dict__":
            return {decode(k, f"{path}.<key>"): decode(v, f"{path}.{k}") for k, v in obj["__dict__"]}
    except PlainStateError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise PlainStateError(f"{path}: a malformed {tag} entry ({type(e).__name__}: {e})") from None
    return type(obj)((k, decode(v, f"{path}.{k}")) for k, v in obj.items())
