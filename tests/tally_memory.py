"""A memory kind written as one module, as a plugin would write one: ``tally``.

Each finished episode becomes a note in the bank (``"<action> won"`` / ``"<action> lost"``), written by a
request type of this module on the manager's worker thread; the kind also keeps, on the track's side,
a tally of wins per env and action, which a guided episode is shown above the notes retrieved for it
and which a checkpoint keeps (:meth:`TallyMemory.state_dict`). Nothing of the package knows it:
``tests/trainer/test_memory_kinds.py`` registers :data:`TALLY` with ``register_method`` and runs it
end to end.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from crl_bench.experience.memory import Memory, guidance_text, register_memory
from crl_bench.experience.requests import Request
from crl_bench.experience.types import Operation
from crl_bench.methods import MethodSpec

TALLY_HEADER = "Notes on earlier episodes, with how often each action won."


@dataclass
class NoteRequest(Request):
    """One note for the bank: ``text`` about an episode of ``env_id``, keyed by its retrieval query."""

    order: ClassVar[int] = 40
    needs: ClassVar[str] = "notes"
    env_id: str
    step: int
    text: str
    key_text: str = ""

    @classmethod
    def handle(cls, manager: Any, requests: list[NoteRequest]) -> None:
        """Add each note as an entry (under the bank's write lock)."""
        for r in requests:
            with manager.lock.write():
                manager.bank.apply([Operation("ADD", r.env_id, r.text)], env_id=r.env_id, step=r.step,
                                   extraction_id=uuid.uuid4().hex, extractor_version=0, key_text=r.key_text)
            with manager.tally() as st:
                st.distilled += 1


class NoteWriter:
    """The manager's writer of a ``tally`` bank: no model (it answers no search-tool question)."""

    answers: ClassVar[bool] = False
    notes = True


@register_memory("tally")
class TallyMemory(Memory):
    """Notes on every finished episode, and a tally of wins per env and action shown to guided episodes."""

    header: ClassVar[str] = TALLY_HEADER
    whole_episodes: ClassVar[bool] = True

    def __init__(self, cfg: Any, actor_engine: Any = None, tokenizer: Any = None) -> None:
        super().__init__(cfg, actor_engine, tokenizer)
        self.wins: dict[str, dict[str, int]] = {}

    def writer(self, engine: Any, tokenizer: Any) -> Any:
        """A :class:`NoteWriter`: the kind loads no model."""
        return NoteWriter()

    def write(self, manager: Any, trajs: Sequence[Any], step: int) -> int:
        """Count each won episode's first action; queue a note on every episode with a turn."""
        reqs = []
        for t in trajs:
            if not t.turns:
                continue
            action = t.turns[0].action or "nothing"
            if t.success:
                env = self.wins.setdefault(t.env_id, {})
                env[action] = env.get(action, 0) + 1
            reqs.append(NoteRequest(t.env_id, step, f"{action} {'won' if t.success else 'lost'}", t.query))
        if reqs:
            manager.submit(reqs)
        return len(reqs)

    def guidance(self, manager: Any, env_ids: Sequence[str], bodies: Sequence[str]) -> list[str]:
        """The env's win tally above the notes retrieved, under :data:`TALLY_HEADER`."""
        out = []
        for env_id, body in zip(env_ids, bodies):
            tally = ", ".join(f"{a} {n}" for a, n in sorted(self.wins.get(env_id, {}).items()))
            out.append(guidance_text("\n".join(p for p in (f"Wins: {tally}" if tally else "", body) if p),
                                     self.header))
        return out

    def metrics(self, manager: Any, stats: dict[str, Any]) -> dict[str, Any]:
        """``tally_wins``: the wins counted so far."""
        return {"tally_wins": sum(n for env in self.wins.values() for n in env.values())}

    def state_dict(self) -> dict[str, Any]:
        """The tally (``wins``: env -> action -> wins)."""
        return {"wins": {env: dict(counts) for env, counts in self.wins.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.wins = {env: dict(counts) for env, counts in state.get("wins", {}).items()}


TALLY = MethodSpec(name="tally", description="GRPO actor guided by notes on earlier episodes and a win tally",
                   uses_experience=True, memory="tally")
