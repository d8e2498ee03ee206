"""Outcome advantages computed within groups (GRPO) or within subgroups of a group.

GRPO (Shao et al. 2024, DeepSeekMath, section 4.1): each task is rolled out G times; an episode's
advantage is its outcome reward minus the mean reward of its group, optionally divided by the group's
standard deviation.  Complementary RL (arXiv 2603.17621; docs/method.md) splits each group into an
experience-free and an experience-guided subgroup and centres within each subgroup separately; the
released code uses mean-centring without std division, our default.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence


def grouped_advantages(rewards: Sequence[float], keys: Sequence[Hashable], std_normalize: bool = False,
                       eps: float = 1e-6) -> list[float]:
    """Advantages of episodes centred within the set of episodes sharing a key.

    Args:
        rewards: outcome reward per episode, length N.
        keys: group key per episode, length N: a group id for GRPO, ``(group id, subgroup)`` for
            subgroup advantages.
        std_normalize: divide by the (population) std of the key's rewards plus ``eps``.
        eps: numerical floor of the std.

    Returns:
        Advantage per episode, length N.  A key with a single episode, or whose rewards are all equal,
        gets advantage 0 (no learning signal), never a division by zero.

    Raises:
        ValueError: ``rewards`` and ``keys`` differ in length.
    """
    if len(rewards) != len(keys):
        raise ValueError(f"{len(rewards)} rewards but {len(keys)} keys")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        members[k].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
        for i, v in zip(idx, vals):
            a = v - mean
            if std_normalize:
                a = a / (std + eps)
            out[i] = a
    return out
