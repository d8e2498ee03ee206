"""WebShop goals as upstream ``web_agent_site/engine/goal.py`` (``get_synthetic_goals``,
``get_human_goals``) and the shuffle of ``web_agent_site/envs/web_agent_text_env.py::SimServer.__init__``.

Deliberate difference from upstream: the price limits are drawn with ``random.Random(seed)`` rather
than the unseeded global RNG (same draws, same order: one per synthetic product, one per human record).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .products import Catalogue

PRICE_RANGE = [10.0 * i for i in range(1, 100)]
NO_PRICE_LIMIT = 1000000.0
SHUFFLE_SEED = 233


@dataclass
class Goal:
    """One goal (upstream's goal dict).

    Attributes:
        asin: the target product. category, query (lowercased), name (product name), product_category:
            the target's, used by the reward's type factor.
        instruction_text: what the agent is shown (without the "Instruction: " prefix).
        attributes: the instruction attributes (non-empty).
        price_upper: dollars; ``1000000.0`` when the target costs >= 980 (no limit in the text).
        goal_options: synthetic: ``{option name: value}`` in sorted-name order; human: a list of strings.
        weight: synthetic: mean of ``1 / count(attribute)`` over the goal's attributes (counts over all
            synthetic goals); human: 1.0.
    """

    asin: str
    category: str
    query: str
    name: str
    product_category: str
    instruction_text: str
    attributes: list[str]
    price_upper: float
    goal_options: dict[str, str] | list[str]
    weight: float = 1.0


def draw_price_upper(price: float, rng: random.Random) -> tuple[float, str]:
    """``(price_upper, price text)`` for a target that costs ``price`` dollars.

    The candidates are the first 4 of 10, 20, ..., 990 strictly above ``price``; with at least 2, the limit
    is the larger of 2 distinct ``rng.sample`` picks and the text is ``', and price lower than X.XX dollars'``;
    otherwise ``(1000000.0, '')`` (no draw). Follows ``goal.py::get_synthetic_goals`` / ``get_human_goals``.
    """
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return NO_PRICE_LIMIT, ""
    upper = max(rng.sample(candidates, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def _synthetic_goals(cat: Catalogue, rng: random.Random) -> list[Goal]:
    goals: list[Goal] = []
    counts: dict[str, int] = {}
    for p in cat.products:
        if p.instruction_text is None:
            continue
        attributes = p.instruction_attributes
        if not attributes:
            raise ValueError(f"WebShop: product {p.asin} has an instruction but no instruction attributes")
        upper, price_text = draw_price_upper(cat.prices[p.asin], rng)
        names = sorted(p.options)
        for combo in itertools.product(*(p.options[n] for n in names)):
            options = dict(zip(names, combo))
            option_text = ", and ".join(f"{k}: {v}" for k, v in options.items())
            option_text = f" with {option_text}" if option_text else ""
            goals.append(Goal(p.asin, p.category, p.query, p.title, p.product_category,
                              f"{p.instruction_text}{option_text}{price_text}", attributes, upper, options))
            for a in attributes:
                counts[a] = counts.get(a, 0) + 1
    for g in goals:
        g.weight = sum(1.0 / counts[a] for a in g.attributes) / len(g.attributes)
    return goals


def _human_goals(cat: Catalogue, rng: random.Random) -> list[Goal]:
    goals: list[Goal] = []
    for p in cat.products:
        for rec in p.human_instructions or []:
            if len(rec["instruction_attributes"]) == 0:
                continue
            upper, price_text = draw_price_upper(cat.prices[p.asin], rng)
            goals.append(Goal(p.asin, p.category, p.query, p.name, p.product_category,
                              rec["instruction"].strip(".") + price_text, rec["instruction_attributes"], upper,
                              rec["instruction_options"], 1.0))
    return goals


def build_goals(cat: Catalogue, human_goals: bool = False, seed: int = 0) -> list[Goal]:
    """All goals of ``cat`` in upstream's order: built in load order, then shuffled as
    ``random.seed(233); random.shuffle(goals)`` (``random.Random(233)`` gives the same permutation).

    Synthetic (``goal.py::get_synthetic_goals``): one goal per combination of option values (options in
    sorted-name order; a product without options gives one goal with ``{}``) of each product with an
    instruction. Human (``goal.py::get_human_goals``): one goal per instruction record with non-empty
    ``instruction_attributes``. ``seed`` seeds the price-limit draws (see :func:`draw_price_upper`).
    With the 1k data: 6,910 synthetic goals, 13 human goals.

    Raises:
        ValueError: ``human_goals`` differs from what ``cat`` was loaded with (its other instruction fields
            are absent), or a synthetic instruction has no attributes (upstream: AssertionError).
    """
    if bool(human_goals) != cat.human_goals:
        raise ValueError(f"WebShop: goals with human_goals={human_goals} need a catalogue loaded with "
                         f"load_catalogue(..., human_goals={bool(human_goals)})")
    rng = random.Random(seed)
    goals = _human_goals(cat, rng) if human_goals else _synthetic_goals(cat, rng)
    random.Random(SHUFFLE_SEED).shuffle(goals)
    return goals


def sample_goal(goals_idx: Sequence[int], weights: Sequence[float], rng: random.Random) -> int:
    """One of ``goals_idx`` drawn with probability proportional to its goal weight.

    ``weights`` is indexed by goal index (``[g.weight for g in goals]``), not by position in ``goals_idx``.
    Upstream (``web_agent_site/utils.py::random_idx`` on ``[0] + cumsum(weights)``, used by
    ``SimServer.receive`` when no goal index is given) is off by one: it returns goal k+1 when the draw falls in
    goal k's interval, so goal 0 is never drawn and the last goal gets two goals' mass. That quirk is NOT
    reproduced here. (Upstream's baseline ``WebEnv`` instead samples its split's indices uniformly.)

    Raises:
        ValueError: ``goals_idx`` is empty or its weights sum to zero.
    """
    if not goals_idx:
        raise ValueError("sample_goal: no goal indices to sample from")
    return rng.choices(goals_idx, weights=[weights[i] for i in goals_idx])[0]
