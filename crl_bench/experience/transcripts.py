"""Episodes as text: the record of a finished episode that the memory kinds write from, and its
renderings within a token budget.

* :class:`EpisodeRecord` is the text view of an episode; the integrator fills it from the rollout
  (observation before each action, the action, the env's feedback, the actor's whole replies).
* :func:`compact_trajectory` renders a record within a token budget (one line per action with its
  feedback, the last observations; for small models); :func:`full_transcript` renders every
  observation and the actor's whole replies (reasoning included), as the released extractor reads
  them (``extractor.transcript: full``; pUmpKin-Co/ComplementaryRL, the memory manager's transcript).
* :func:`outcome_text` is the outcome line every kind states.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EpisodeRecord", "Transcript", "compact_trajectory", "count_tokens", "cut_tokens", "full_transcript",
           "outcome_text", "strip_observation"]


@dataclass
class EpisodeRecord:
    """A finished episode as text.

    Attributes:
        env_id: environment id (e.g. ``"sokoban"``).
        task_prompt: the task as told to the actor (``env.task_prompt()``).
        steps: one ``(observation, action, feedback)`` per actor decision, in order: the observation
            the action was chosen in, the action text (canonical action, or the raw reply when it was
            invalid) and a short feedback line (e.g. ``"You bumped into a wall"``; may be empty).
        success: the env's final ``info["success"]``.
        reward: episode return.
        final_obs: the observation after the last action (empty if unknown).
        group_id: GRPO group of the episode (copied into the :class:`Extraction`).
        source: any key identifying the episode (copied to ``Extraction.source_episode``).
        meta: free-form extras (not rendered).
        replies: the actor's whole reply at each step (reasoning included; same length as ``steps``,
            or empty when unknown), shown by :func:`full_transcript`.
        outcome: how the outcome line reads instead of :func:`outcome_text` ("" = that default; a
            turn record says the step's reward).
    """

    env_id: str
    task_prompt: str
    steps: list[tuple[str, str, str]] = field(default_factory=list)
    success: bool = False
    reward: float = 0.0
    final_obs: str = ""
    group_id: int = 0
    source: Any = None
    meta: dict = field(default_factory=dict)
    replies: list[str] = field(default_factory=list)
    outcome: str = ""


Transcript = Literal["compact", "full"]
"""Values of ``extractor.transcript``: how the extractor reads an episode (:func:`compact_trajectory`)."""

_BOILERPLATE_PREFIXES = ("valid actions:", "last:")


def strip_observation(obs: str) -> str:
    """Default observation hook of the extractor prompt: drops the ``Valid actions:`` and ``Last:``
    lines our envs repeat in every observation (the feedback is shown on the step line instead)."""
    keep = [ln for ln in (obs or "").splitlines() if not ln.strip().lower().startswith(_BOILERPLATE_PREFIXES)]
    return "\n".join(keep).strip()


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def cut_tokens(tokenizer: Any, text: str, max_tokens: int | None, marker: str = " ...(cut)") -> str:
    """``text`` cut to at most ``max_tokens`` tokens (marker included); unchanged when it fits."""
    if max_tokens is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    room = max(max_tokens - count_tokens(tokenizer, marker), 0)
    while room > 0:
        out = tokenizer.decode(ids[:room], skip_special_tokens=True).rstrip() + marker
        if count_tokens(tokenizer, out) <= max_tokens:
            return out
        room -= 1
    return ""


def _summary(steps: Sequence[tuple[str, str, str]], first: int, last: int) -> str:
    """One line standing for steps ``first..last`` (1-based, inclusive)."""
    acts = Counter(" ".join(a.split())[:30] or "(empty)" for _, a, _ in steps)
    fbs = Counter(" ".join(f.split())[:60] for _, _, f in steps if f and f.strip())
    act_txt = ", ".join(f"{a} x{c}" for a, c in acts.most_common(6))
    if len(acts) > 6:
        act_txt += ", ..."
    line = f"... steps {first}-{last} omitted ({last - first + 1} steps). Actions: {act_txt}."
    if fbs:
        line += " Feedback: " + "; ".join(f'"{f}" x{c}' for f, c in fbs.most_common(3)) + "."
    return line


def _step_line(i: int, action: str, feedback: str) -> str:
    action = " ".join(action.split()) or "(empty)"
    feedback = " ".join(feedback.split())
    return f"Step {i}: {action}" + (f" -> {feedback}" if feedback else "")


def _render(record: EpisodeRecord, obs: Callable[[str], str], tail_full: int, brief: int) -> str:
    steps = record.steps
    n = len(steps)
    lines: list[str] = []
    if n == 0:
        lines.append("Start:\n" + (obs(record.final_obs) or "(no observation)"))
        lines.append("No action was taken.")
        return "\n".join(lines)
    lines.append("Start:\n" + obs(steps[0][0]))
    full_from = max(1, n - tail_full)          # 0-based steps >= full_from show their observation
    one_liners = list(range(0, full_from))
    if len(one_liners) > brief:
        head = max(1, brief // 4) if brief > 0 else 0
        tail = brief - head
        kept_head = one_liners[:head]
        kept_tail = one_liners[len(one_liners) - tail:] if tail else []
        gap = one_liners[head:len(one_liners) - tail]
    else:
        kept_head, kept_tail, gap = one_liners, [], []
    for i in kept_head:
        lines.append(_step_line(i + 1, steps[i][1], steps[i][2]))
    if gap:
        lines.append(_summary([steps[i] for i in gap], gap[0] + 1, gap[-1] + 1))
    for i in kept_tail:
        lines.append(_step_line(i + 1, steps[i][1], steps[i][2]))
    for i in range(full_from, n):
        lines.append(f"Before step {i + 1}:\n" + obs(steps[i][0]))
        lines.append(_step_line(i + 1, steps[i][1], steps[i][2]))
    if tail_full > 0 and record.final_obs.strip():
        lines.append("After the last step:\n" + obs(record.final_obs))
    return "\n".join(lines)


def compact_trajectory(trajectory: EpisodeRecord, tokenizer: Any, max_tokens: int,
                       decode_fn: Callable[[str], str] | None = None) -> str:
    """A textual record of the episode that fits in ``max_tokens`` tokens of ``tokenizer``.

    Layout: the first observation in full (``Start:``), one line per step
    (``Step 7: left -> You bumped into a wall``), the observation before each of the last few steps
    and the observation after the last step.  When that is too long, in this order: fewer of the last
    steps show their observation (3, 2, 1), middle step lines are replaced by one summary line
    (``... steps 3-20 omitted (18 steps). Actions: up x5, left x7. Feedback: "..." x3.``) keeping 24,
    12, 6, then 2 step lines, the last observations are dropped, and observations are cut to 192, 96,
    then 48 tokens.  If even the smallest layout is too long, its head is cut to make room for the
    last step line (or, with no room for that, the whole text is cut at the budget).

    Args:
        trajectory: the :class:`EpisodeRecord` (any object with its fields works).
        tokenizer: measures length (``encode(text, add_special_tokens=False)``).
        max_tokens: token budget of the returned text.
        decode_fn: optional hook applied to every observation before it is shown and measured, e.g.
            to drop lines that repeat in every observation (a legend); default: strip whitespace.

    Returns:
        The text (``""`` when ``max_tokens <= 0``).
    """
    if max_tokens <= 0:
        return ""
    hook = decode_fn or (lambda s: s)
    n = len(trajectory.steps)
    smallest = ""
    for cap in (None, 192, 96, 48):
        memo: dict[str, str] = {}

        def obs(text: str, _cap=cap, _memo=memo) -> str:
            if text not in _memo:
                _memo[text] = cut_tokens(tokenizer, (hook(text) or "").strip(), _cap)
            return _memo[text]
        for tail_full, brief in ((3, n), (2, n), (1, n), (1, 24), (1, 12), (1, 6), (1, 2), (0, 6), (0, 2)):
            text = _render(trajectory, obs, tail_full, brief)
            smallest = text
            if count_tokens(tokenizer, text) <= max_tokens:
                return text
    # nothing fits: cut the head of the smallest layout and keep its last line (the last step)
    head, _, last = smallest.rpartition("\n")
    room = max_tokens - count_tokens(tokenizer, "\n" + last)
    if n and head and room >= max_tokens // 2:
        cut = cut_tokens(tokenizer, head, room)
        text = cut + "\n" + last
        if cut and count_tokens(tokenizer, text) <= max_tokens:
            return text
    return cut_tokens(tokenizer, smallest, max_tokens)


def _full_render(record: EpisodeRecord, keep: set[int] | None) -> str:
    """The whole transcript; with ``keep``, only those 0-based steps (a marker stands for the rest)."""
    n = len(record.steps)
    replies = record.replies if len(record.replies) == n else [a for _, a, _ in record.steps]
    lines: list[str] = []
    skipped = 0
    for i, (obs, _, _) in enumerate(record.steps):
        if keep is not None and i not in keep:
            skipped += 1
            continue
        if skipped:
            lines.append(f"[... {skipped} turns omitted ...]")
            skipped = 0
        lines.append(f"Environment: {obs.strip() or '(no observation)'}")
        lines.append(f"Agent: {replies[i].strip() or '(empty reply)'}")
    if skipped:
        lines.append(f"[... {skipped} turns omitted ...]")
    if record.final_obs.strip() or n == 0:
        lines.append(f"Environment: {record.final_obs.strip() or '(no observation)'}")
    return "\n".join(lines)


def full_transcript(record: EpisodeRecord, tokenizer: Any, max_tokens: int) -> str:
    """Every observation and the actor's whole replies (reasoning included), within ``max_tokens``.

    The released extractor reads the episode's full message list with the actor's replies as written
    (``build_memory_model_messages``, ``memory_model_build_message_pattern: null`` in the example
    config).  When the whole transcript does not fit, the turns in the middle are left out (a marker
    says how many), keeping the first turn and as many of the last ones as fit; when even that does not
    fit, :func:`compact_trajectory` renders the episode.  Returns ``""`` for ``max_tokens <= 0``.
    """
    if max_tokens <= 0:
        return ""
    text = _full_render(record, None)
    if count_tokens(tokenizer, text) <= max_tokens:
        return text
    n = len(record.steps)
    for tail in range(n - 2, 0, -1):
        text = _full_render(record, {0, *range(n - tail, n)})
        if count_tokens(tokenizer, text) <= max_tokens:
            return text
    return compact_trajectory(record, tokenizer, max_tokens)


def outcome_text(record: EpisodeRecord) -> str:
    """``"success (reward 1.00) after 7 steps"`` / ``"failure (reward 0.00) after 30 steps"``, or the
    record's own ``outcome`` line when it has one."""
    if record.outcome:
        return record.outcome
    word = "success" if record.success else "failure"
    return f"{word} (reward {record.reward:.2f}) after {len(record.steps)} steps"
