"""Training methods as configurations of the one training loop.

A method says which parts of the loop are active; it never brings a loop of its own (the baselines
package only declares specs).  ``crl-bench run --method NAME`` looks the name up here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MethodSpec:
    """What one method turns on.

    Attributes:
        name: the ``--method`` value.
        description: one line for ``crl-bench run --help`` and the leaderboard.
        uses_experience: retrieve from an experience bank and split groups into guided/free subgroups.
        trains_extractor: update the experience extractor (CISPO).
        overrides: config mapping applied on top of the preset/config file (same keys as YAML).
    """

    name: str
    description: str
    uses_experience: bool = False
    trains_extractor: bool = False
    overrides: dict = field(default_factory=dict)


_METHODS: dict[str, MethodSpec] = {}
_unavailable: dict[str, str] = {}


def register_method(spec: MethodSpec) -> None:
    """Make ``spec`` available to ``--method``."""
    _METHODS[spec.name] = spec


def _load_builtin() -> None:
    import crl_bench.baselines
    if "complementary" not in _METHODS:
        try:
            import crl_bench.trainer.complementary  # noqa: F401 - imported to register complementary
        except ImportError as e:  # the experience stack's packages are missing
            _unavailable["complementary"] = str(e)


def get_method(name: str) -> MethodSpec:
    """The spec of ``name``. Raises ``KeyError`` naming the known methods."""
    _load_builtin()
    if name not in _METHODS and name in _unavailable:
        raise KeyError(f"method {name!r} cannot be loaded here: {_unavailable[name]}")
    if name not in _METHODS:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def list_methods() -> list[str]:
    _load_builtin()
    return sorted(_METHODS)
