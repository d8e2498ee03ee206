"""``crl-bench bench env --env webshop``: steps per second of the WebShop env.

Scripted episodes over the eval goals, the same shape as an agent's: ``search[<instruction>]``, open the
first result, pick the first value of each option, look at the description, go back, buy. Building the
catalogue, goals and search index happens before the clock starts (once per process, as in training).
Search, click and buy steps are timed separately: a search runs BM25 over the 1,000 documents, a buy
computes the reward (spaCy tags of the two titles, cached after the first time), a click renders a page.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from crl_bench.env_api import make_env


def bench_webshop(episodes: int = 200, env_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``episodes`` scripted episodes (see the module docstring) and time every step.

    Returns:
        ``steps_per_s`` (all steps), ``episodes_per_s``, ``search_ms`` / ``click_us`` / ``buy_ms``
        (mean time of each kind of step), ``steps``, ``episodes``, ``setup_s`` (catalogue, goals, index
        and tagger, paid once per process).

    Raises:
        DataMissingError: no WebShop data in the data dir.
    """
    t0 = time.perf_counter()
    env = make_env("webshop", **(env_kwargs or {}))
    setup_s = time.perf_counter() - t0
    ids = list(env.task_ids("eval"))
    times: dict[str, list[float]] = {"search": [], "click": [], "buy": []}
    wall = 0.0
    for k in range(episodes):
        env.reset(options={"task": ids[k % len(ids)]})

        def act(kind: str, action: str) -> None:
            nonlocal wall
            t = time.perf_counter()
            env.step(f"<answer>{action}</answer>")
            dt = time.perf_counter() - t
            wall += dt
            times[kind].append(dt)

        act("search", f"search[{env.task_prompt()}]")
        first = next((c for c in env.clickables() if c not in ("back to search", "< prev", "next >")), None)
        if first is None:
            continue
        act("click", f"click[{first}]")
        product = env.world.catalogue.by_asin[env.s.asin]
        for values in product.options.values():
            act("click", f"click[{values[0]}]")
        act("click", "click[description]")
        act("click", "click[< prev]")
        act("buy", "click[buy now]")
    steps = sum(len(v) for v in times.values())
    return {
        "episodes": episodes, "steps": steps, "setup_s": setup_s,
        "steps_per_s": steps / wall if wall else float("nan"),
        "episodes_per_s": episodes / wall if wall else float("nan"),
        "search_ms": 1e3 * statistics.fmean(times["search"]) if times["search"] else float("nan"),
        "click_us": 1e6 * statistics.fmean(times["click"]) if times["click"] else float("nan"),
        "buy_ms": 1e3 * statistics.fmean(times["buy"]) if times["buy"] else float("nan"),
    }


def format_result(r: dict[str, Any]) -> str:
    """Human-readable lines of :func:`bench_webshop`'s result."""
    return "\n".join([
        f"webshop bench: {r['episodes']} scripted episodes, {r['steps']} steps "
        f"(setup {r['setup_s']:.1f} s, once per process)",
        f"steps/s {r['steps_per_s']:10.1f}   episodes/s {r['episodes_per_s']:8.1f}",
        f"search step {r['search_ms']:8.2f} ms   click step {r['click_us']:8.1f} us   "
        f"buy step (reward) {r['buy_ms']:8.2f} ms",
    ])


def report(args: argparse.Namespace) -> str:
    """This bench as ``crl-bench bench env --env webshop`` runs it, with the parsed ``--episodes`` (scripted
    episodes, default 200); returns :func:`format_result`'s lines."""
    return format_result(bench_webshop(episodes=args.episodes or 200))
