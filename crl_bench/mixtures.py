"""Task mixtures: which environments a run samples its groups from, and with what weight.

A mixture is data: a YAML file ``envs: {env_id: weight, ...}`` shipped in ``crl_bench/mixtures/``
(``3task``, ``6task`` as in the paper; README "Environments"), a path to such a file, a single env id,
or an inline ``id:weight,id:weight`` list.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import yaml

from crl_bench.config import ConfigError, load_yaml


@dataclass(frozen=True)
class Mixture:
    """Normalised env weights. ``envs[i]`` is sampled with probability ``weights[i]`` (sum 1)."""

    name: str
    envs: tuple[str, ...]
    weights: tuple[float, ...]


def list_mixtures() -> list[str]:
    """Names of the shipped mixtures."""
    return sorted(p.name[:-5] for p in resources.files("crl_bench").joinpath("mixtures").iterdir()
                  if p.name.endswith(".yaml"))


def _from_mapping(name: str, envs: dict) -> Mixture:
    if not isinstance(envs, dict) or not envs:
        raise ConfigError(f"mixture {name!r}: 'envs' must be a non-empty mapping of env id -> weight")
    ids, ws = [], []
    for env_id, w in envs.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w <= 0:
            raise ConfigError(f"mixture {name!r}: weight of {env_id!r} must be a positive number, got {w!r}")
        ids.append(str(env_id))
        ws.append(float(w))
    total = sum(ws)
    return Mixture(name, tuple(ids), tuple(w / total for w in ws))


def resolve_mixture(spec: str) -> Mixture:
    """Turn ``--mix`` text into a :class:`Mixture`.

    Raises:
        ConfigError: empty spec; a file that is missing, binary, not YAML or not a mapping; bad
            weight.  Unknown env ids are reported when the envs are created (the registry names
            the known ones).
    """
    spec = spec.strip()
    if not spec:
        raise ConfigError("rollout.mix is empty")
    if spec in list_mixtures():
        data = yaml.safe_load(resources.files("crl_bench").joinpath("mixtures", f"{spec}.yaml").read_text())
        return _from_mapping(spec, data.get("envs"))
    if spec.endswith((".yaml", ".yml")):
        p = Path(spec)
        data = load_yaml(p, "mixture file")
        return _from_mapping(p.stem, data.get("envs"))
    envs: dict[str, float] = {}
    for part in spec.split(","):
        env_id, _, w = part.strip().partition(":")
        try:
            envs[env_id.strip()] = float(w) if w else 1.0
        except ValueError:
            raise ConfigError(f"mixture {spec!r}: weight {w!r} of {env_id!r} is not a number") from None
    return _from_mapping(spec, envs)


class TaskSampler:
    """Draws (env id, task id) pairs for training groups from a mixture's train splits.

    Args:
        mixture: the mixture.
        task_ids: ``{env_id: sequence of train task ids}``.
        seed: seed of the sampler's own generator (independent of torch/NumPy global state).
    """

    def __init__(self, mixture: Mixture, task_ids: dict, seed: int, task_weights: dict | None = None) -> None:
        self.mixture = mixture
        self.task_ids = task_ids
        self.rng = np.random.default_rng(seed)
        self.task_p: dict[str, np.ndarray] = {}
        for env_id, w in (task_weights or {}).items():
            if w is None:
                continue
            w = np.asarray(w, dtype=np.float64)
            if len(w) != len(task_ids[env_id]) or (w < 0).any() or w.sum() <= 0:
                raise ValueError(f"{env_id}: task weights must be {len(task_ids[env_id])} non-negative "
                                 f"numbers with a positive sum")
            self.task_p[env_id] = w / w.sum()

    def sample(self, n: int) -> list[tuple[str, int]]:
        """``n`` draws; returns ``[(env_id, task_id), ...]``. Tasks are uniform within an env unless
        the env gives weights (``task_weights``, e.g. WebShop's goal weights)."""
        out = []
        for _ in range(n):
            env_id = self.mixture.envs[int(self.rng.choice(len(self.mixture.envs), p=self.mixture.weights))]
            ids = self.task_ids[env_id]
            p = self.task_p.get(env_id)
            k = int(self.rng.choice(len(ids), p=p)) if p is not None else int(self.rng.integers(len(ids)))
            out.append((env_id, int(ids[k])))
        return out
