"""The trainable weights of a model as a plain ``{name: tensor}`` state: what checkpoints save, what
the Ray backend sends to its engine actors and what the data-parallel workers exchange.

With full fine-tuning every parameter trains; with LoRA only the adapters do, so the state is a few
MB instead of the whole model. Names are ``model.named_parameters()`` names (tied weights once).
"""

from __future__ import annotations

from typing import Any

import torch


class WeightsMismatchError(ValueError):
    """A trainable state does not fit a model: other parameter names or shapes (another model, or
    another LoRA setting)."""


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the parameters that train (all of them for full fine-tuning, the
    adapters with LoRA), detached, on the model's device and in its dtype; tied weights appear once
    (``named_parameters``)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: Any, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy :func:`trainable_state` output into ``model`` in place (cast to the dtype and device of
    ``model``'s parameters).

    Args:
        model: a ``torch.nn.Module``.
        state: ``{name: tensor}``, exactly the names of ``model``'s trainable parameters.
        what: names the model in error messages ("actor", "engine weights").

    Raises:
        WeightsMismatchError: names or shapes differ; ``model`` is then unchanged when the names
            differ (checked first), and may be partly written when a shape differs.
    """
    params = dict(model.named_parameters())
    want = {n for n, p in params.items() if p.requires_grad}
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise WeightsMismatchError(f"{what} weights do not fit this model: missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]} (another model or LoRA setting?)")
    with torch.no_grad():
        for n, t in state.items():
            if params[n].shape != t.shape:
                raise WeightsMismatchError(f"{what} weights: {n} has shape {tuple(t.shape)}, "
                                           f"the model {tuple(params[n].shape)}")
            params[n].copy_(t)
