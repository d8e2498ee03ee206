"""Learning alarms: warnings, while a run trains, that it has stopped learning.

:class:`LearningAlarms` is fed each training step's metrics row, in step order
(:meth:`LearningAlarms.update`), and returns the alerts that step raised. The trainer prints each as
a warning line, stores them as ``alerts`` in the step's row of ``metrics.jsonl``; summary.json
(``runs[].alerts``) and report.html list them afterwards. Settings: the ``alarms`` section of the run
config (:class:`~crl_bench.config.AlarmConfig`; defaults in brackets). docs/learning.md "Learning
alarms" says what to check when one fires.

``no_signal`` (``no_signal_steps`` [2])
    For that many consecutive steps no group had a learning signal: a step has none when
    ``groups_with_signal`` (groups whose episodes did not all get the same reward) or ``adv_abs_mean``
    (mean absolute advantage) is 0. Advantages are rewards centred within a group (within each of a
    group's guided and free subgroups for the experience methods, so a group whose subgroups each
    got equal rewards counts in ``groups_with_signal`` but still has advantage 0): when every reward
    of every (sub)group is equal, every advantage is 0 and the policy-gradient loss has no gradient,
    so the update cannot move the actor towards better replies.
``entropy_collapse`` (``entropy_drop`` [0.5])
    ``reply_entropy`` (nats, the entropy of the actor's sampled reply choice) fell below
    ``(1 - entropy_drop)`` times its value at step 1 (the first row that has it). A policy that
    collapses onto one reply per state stops exploring: its groups then get equal rewards and the
    gradient vanishes, and what it has not found it will not find.
``extractor_parse`` (``parse_rate`` [0.5])
    The share of the extractor's replies finished during the step that parsed into at least one
    operation (``extractions_parse_rate``; of ``extractions_step`` replies) is below ``parse_rate``.
    Replies that do not parse write nothing to the bank, so the experience side stops improving;
    with ``extractor.invalid_reward`` unset they are not trained on either.
``merge_stale`` (``merge_passes`` [3])
    That many merge passes running wrote nothing (``merge_pass_writes``: MERGE and UPDATE
    operations applied plus the entries a fold pass rewrote, 0). The bank is then only appended to:
    duplicates pile up and retrieval returns near-copies instead of distilled lessons.
``guided_equals_free`` (``guided_free_steps`` [5], ``noise_z`` [1.96])
    For that many steps running the guided and the free subgroup's training success
    (``success_rate/guided``, ``success_rate/free`` over ``episodes/guided``, ``episodes/free``
    episodes) were equal within noise: ``|g - f| <= noise_z * se`` with
    ``se = sqrt(g (1 - g) / n_g + f (1 - f) / n_f)``. The experience shown to the guided episodes
    then makes no measurable difference: the bank holds nothing the actor can use, or the actor
    ignores it. When ``se`` is 0 (both rates 0, or both 1) the rates count as equal only when they
    are the same (``|g - f| <= 0``); a 1 against a 0 is a difference, not noise.

Firing: each alarm has a condition (a streak of at least N steps or passes, or a threshold crossed
at this step). An alert is raised at the step where the condition starts to hold, not again while it
keeps holding, and again only after it has cleared (a step or pass that breaks the streak, a value
back on the good side of the threshold) and then holds once more. A long stale stretch therefore
gives one line, not one per step.

Absent quantities: a row without an alarm's quantity leaves that alarm's streak and state as they
were: it neither advances nor resets it. So do ``grpo`` rows for the extractor, merge and guided/free
alarms, steps without a merge pass (or whose pass was skipped), steps where no extractor reply
finished, rows of an engine that reports no entropies, and for ``guided_equals_free`` warm-up rows
(``warmup``: the guided subgroup retrieves nothing, or the step does not train) and rows with an
empty subgroup.
"""

from __future__ import annotations

import math
from typing import Any

from crl_bench.config import AlarmConfig

#: Alarm names, in the order :meth:`LearningAlarms.update` checks them.
ALARMS = ("no_signal", "entropy_collapse", "extractor_parse", "merge_stale", "guided_equals_free")


def _num(row: dict[str, Any], key: str) -> float | None:
    """``row[key]`` as a float, or ``None`` when absent or not a finite number."""
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        return None
    return float(v)


class LearningAlarms:
    """The learning alarms of one run (module doc).

    Args:
        cfg: the ``alarms`` settings; with ``cfg.enabled`` false :meth:`update` returns no alert
            and keeps no state.
    """

    def __init__(self, cfg: AlarmConfig) -> None:
        self.cfg = cfg
        # consecutive steps (no_signal, guided_equals_free) or merge passes (merge_stale) so far
        self.streaks: dict[str, int] = {"no_signal": 0, "merge_stale": 0, "guided_equals_free": 0}
        # whether each alarm's condition held at its last evaluation (an alert fires on False -> True)
        self.active: dict[str, bool] = {name: False for name in ALARMS}
        # reply_entropy (nats) of the first row that had it, and that row's step
        self.entropy_ref: float | None = None
        self.entropy_ref_step: int | None = None
        # first step of the current no_signal / guided_equals_free streak
        self.streak_start: dict[str, int | None] = {"no_signal": None, "guided_equals_free": None}

    # ---- one step ---------------------------------------------------------------------------------
    def update(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Take in one training step's metrics row (in step order) and return the alerts it raised.

        Each alert is ``{"alarm": name, "step": int, "message": str, ...}`` plus the numbers that
        triggered it (per alarm: see the ``_check_*`` methods). Returns ``[]`` when nothing fired
        or alarms are disabled.
        """
        if not self.cfg.enabled:
            return []
        step = int(row.get("step", 0))
        out: list[dict[str, Any]] = []
        for check in (self._check_no_signal, self._check_entropy, self._check_parse,
                      self._check_merge, self._check_guided_free):
            alert = check(row, step)
            if alert is not None:
                out.append(alert)
        return out

    def _streak(self, name: str, holds: bool, step: int) -> tuple[int, int | None]:
        """Extend ``name``'s streak of steps (from ``step`` on, if it starts here) when its condition
        ``holds``, else end it; returns ``(streak length, its first step or None)``."""
        if holds:
            if self.streaks[name] == 0:
                self.streak_start[name] = step
            self.streaks[name] += 1
        else:
            self.streaks[name] = 0
            self.streak_start[name] = None
        return self.streaks[name], self.streak_start[name]

    def _transition(self, name: str, holds: bool) -> bool:
        """Record whether ``name``'s condition holds now; True when it just started to hold."""
        fire = holds and not self.active[name]
        self.active[name] = holds
        return fire

    def _check_no_signal(self, row: dict[str, Any], step: int) -> dict[str, Any] | None:
        """``no_signal``: numbers ``steps`` (streak length), ``first_step``, ``groups_with_signal``,
        ``adv_abs_mean`` (of this step) and ``threshold`` (``no_signal_steps``)."""
        groups, adv = _num(row, "groups_with_signal"), _num(row, "adv_abs_mean")
        if groups is None and adv is None:
            return None
        n, first = self._streak("no_signal", groups == 0 or adv == 0, step)
        need = self.cfg.no_signal_steps
        if not self._transition("no_signal", n >= need):
            return None
        return {"alarm": "no_signal", "step": step,
                "message": (f"no learning signal for {n} steps running (steps {first}-{step}): every group's "
                            "episodes got the same reward, so every advantage is 0 and the update has no "
                            "policy gradient"),
                "steps": n, "first_step": first, "groups_with_signal": groups, "adv_abs_mean": adv,
                "threshold": need}

    def _check_entropy(self, row: dict[str, Any], step: int) -> dict[str, Any] | None:
        """``entropy_collapse``: numbers ``reply_entropy`` (nats, this step), ``reference`` (nats,
        at ``reference_step``), ``limit`` (nats, ``(1 - entropy_drop) * reference``) and
        ``entropy_drop``."""
        ent = _num(row, "reply_entropy")
        if ent is None:
            return None
        if self.entropy_ref is None:
            self.entropy_ref, self.entropy_ref_step = ent, step
            return None
        limit = (1.0 - self.cfg.entropy_drop) * self.entropy_ref
        if not self._transition("entropy_collapse", ent < limit):
            return None
        return {"alarm": "entropy_collapse", "step": step,
                "message": (f"reply_entropy {ent:.3f} nats fell below {limit:.3f} ({1 - self.cfg.entropy_drop:.0%} "
                            f"of its {self.entropy_ref:.3f} at step {self.entropy_ref_step}): the actor is "
                            "collapsing onto one reply per state and stops exploring"),
                "reply_entropy": ent, "reference": self.entropy_ref, "reference_step": self.entropy_ref_step,
                "limit": limit, "entropy_drop": self.cfg.entropy_drop}

    def _check_parse(self, row: dict[str, Any], step: int) -> dict[str, Any] | None:
        """``extractor_parse``: numbers ``parse_rate`` (this step's share of parsed replies),
        ``replies`` (the step's finished replies) and ``threshold`` (``parse_rate`` setting)."""
        rate = _num(row, "extractions_parse_rate")
        if rate is None:
            return None
        need = self.cfg.parse_rate
        if not self._transition("extractor_parse", rate < need):
            return None
        replies = row.get("extractions_step")
        return {"alarm": "extractor_parse", "step": step,
                "message": (f"only {rate:.0%} of the extractor's {replies} replies of this step parsed into an "
                            f"operation (alarm below {need:.0%}): unparsed replies write nothing to the bank"),
                "parse_rate": rate, "replies": replies, "threshold": need}

    def _check_merge(self, row: dict[str, Any], step: int) -> dict[str, Any] | None:
        """``merge_stale``: numbers ``passes`` (stale passes running), ``calls`` (extractor calls of
        this step's pass) and ``threshold`` (``merge_passes``)."""
        writes = _num(row, "merge_pass_writes")
        if _num(row, "merge_pass") != 1 or writes is None:
            return None
        self.streaks["merge_stale"] = self.streaks["merge_stale"] + 1 if writes == 0 else 0
        n, need = self.streaks["merge_stale"], self.cfg.merge_passes
        if not self._transition("merge_stale", n >= need):
            return None
        return {"alarm": "merge_stale", "step": step,
                "message": (f"{n} merge passes running wrote nothing (no MERGE, UPDATE or fold rewrite): "
                            "the bank is only appended to"),
                "passes": n, "calls": row.get("merge_pass_calls"), "threshold": need}

    def _check_guided_free(self, row: dict[str, Any], step: int) -> dict[str, Any] | None:
        """``guided_equals_free``: numbers ``steps`` (streak length), ``first_step``, ``guided``,
        ``free`` (this step's success rates), ``n_guided``, ``n_free`` (their episodes), ``se``
        (standard error of the difference) and ``threshold`` (``guided_free_steps``)."""
        g, f = _num(row, "success_rate/guided"), _num(row, "success_rate/free")
        ng, nf = _num(row, "episodes/guided"), _num(row, "episodes/free")
        if g is None or f is None or not ng or not nf or row.get("warmup"):
            return None
        se = math.sqrt(max(g * (1 - g), 0.0) / ng + max(f * (1 - f), 0.0) / nf)
        n, first = self._streak("guided_equals_free", abs(g - f) <= self.cfg.noise_z * se, step)
        need = self.cfg.guided_free_steps
        if not self._transition("guided_equals_free", n >= need):
            return None
        return {"alarm": "guided_equals_free", "step": step,
                "message": (f"guided and free training success equal within noise for {n} steps running "
                            f"(steps {first}-{step}; now guided {g:.3f} over {int(ng)}, free {f:.3f} over "
                            f"{int(nf)}, |diff| <= {self.cfg.noise_z:g} x se {se:.3f}): the experience makes "
                            "no measurable difference"),
                "steps": n, "first_step": first, "guided": g, "free": f, "n_guided": int(ng), "n_free": int(nf),
                "se": se, "threshold": need}

    # ---- resumable state (Trainer.state_dict) -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Streaks, which conditions hold and the entropy reference: what an exact resume needs to
        raise the same alerts at the same steps as the uninterrupted run."""
        return {"streaks": dict(self.streaks), "active": dict(self.active), "entropy_ref": self.entropy_ref,
                "entropy_ref_step": self.entropy_ref_step, "streak_start": dict(self.streak_start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; alarms missing from ``state`` keep their fresh state."""
        self.streaks.update({k: int(v) for k, v in state.get("streaks", {}).items() if k in self.streaks})
        self.active.update({k: bool(v) for k, v in state.get("active", {}).items() if k in self.active})
        self.streak_start.update({k: v for k, v in state.get("streak_start", {}).items() if k in self.streak_start})
        ref = state.get("entropy_ref")
        self.entropy_ref = None if ref is None else float(ref)
        ref_step = state.get("entropy_ref_step")
        self.entropy_ref_step = None if ref_step is None else int(ref_step)


def alert_line(alert: dict[str, Any]) -> str:
    """One console warning line for an alert."""
    return f"WARNING learning alarm {alert['alarm']} at step {alert['step']}: {alert['message']}"


def run_alerts(rows: Any) -> list[dict[str, Any]]:
    """Every alert of a run, in step order, from its metrics rows (training rows' ``alerts`` lists;
    a step logged twice counts once: its last row)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if not isinstance(row, dict) or "eval" in row:
            continue
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        alerts = row.get("alerts")
        by_step[step] = [a for a in alerts if isinstance(a, dict)] if isinstance(alerts, list) else []
    return [a for s in sorted(by_step) for a in by_step[s]]
