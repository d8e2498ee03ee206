"""The actor's turn prompts: :class:`PromptBuilder` lays out and tokenises each turn of an episode in
one of two layouts (``rollout.prompt``): ``window`` rebuilds each turn's prompt from the system prompt,
the task, the last ``history`` actions with their feedback and the current observation; ``multiturn``
(the released format) keeps one chat per episode that grows by the actor's reply and the next
observation, token-in, token-out, so an episode's prompts are append-only. Retrieved experience goes
once into the system prompt (``placement="system"``, released) or into every user message (``"user"``).
The rollout loop (:mod:`crl_bench.rollout`) calls it every turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from crl_bench.env_api import DEFAULT_REPLY_INSTRUCTION

__all__ = ["PLACEMENTS", "PROMPT_LAYOUTS", "Placement", "PromptBuilder", "PromptLayout"]


PromptLayout = Literal["window", "multiturn"]
"""Values of ``rollout.prompt``: how a turn's prompt is laid out (:class:`PromptBuilder`)."""
PROMPT_LAYOUTS: tuple[str, ...] = get_args(PromptLayout)
Placement = Literal["system", "user"]
"""Values of ``experience.placement``: where retrieved experience goes in the prompt."""
PLACEMENTS: tuple[str, ...] = get_args(Placement)


class PromptBuilder:
    """Builds the chat prompt of a turn and tokenises it.

    The assistant turn is opened with ``prefill`` (default ``<answer>``), so the actor's first token is
    already the action; the reply is parsed as ``prefill + reply``.

    Args:
        tokenizer: a tokenizer with a chat template.
        prefill: text appended after the generation prompt.
        history: how many previous (action, feedback) pairs to repeat (``window`` layout).
        layout: ``window`` or ``multiturn`` (see the module docstring).
        placement: where guidance goes: ``system`` (appended once to the system prompt) or ``user``.

    Raises:
        ValueError: unknown ``layout`` or ``placement``.
    """

    def __init__(self, tokenizer: Any, prefill: str = "<answer>", history: int = 2, layout: str = "window",
                 placement: str = "user") -> None:
        if layout not in PROMPT_LAYOUTS:
            raise ValueError(f"prompt layout must be one of {PROMPT_LAYOUTS}, got {layout!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"guidance placement must be one of {PLACEMENTS}, got {placement!r}")
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.history = history
        self.layout = layout
        self.placement = placement

    def system_text(self, system: str, guidance: str = "") -> str:
        """The system message: the env's system prompt, plus the guidance with ``placement="system"``."""
        if guidance and self.placement == "system":
            return f"{system.rstrip()}\n\n{guidance.strip()}" if system else guidance.strip()
        return system

    def user_text(self, task_prompt: str, history: Sequence[tuple[str, str]], obs: str,
                  guidance: str = "", reply: str = DEFAULT_REPLY_INSTRUCTION) -> str:
        """The user message of a ``window`` turn (and of a ``multiturn`` episode's first turn, with no
        history); guidance appears here only with ``placement="user"``."""
        parts = []
        if task_prompt:
            parts.append(f"Task: {task_prompt}")
        if guidance and self.placement == "user":
            parts.append(guidance.strip())
        if history and self.history:
            recent = history[-self.history:]
            lines = [f"- {a}" + (f" -> {fb}" if fb else "") for a, fb in recent]
            parts.append("Your last actions:\n" + "\n".join(lines))
        parts.append(obs.strip())
        parts.append(reply)
        return "\n\n".join(parts)

    def task_text(self, system: str, task_prompt: str, obs: str, reply: str = DEFAULT_REPLY_INSTRUCTION) -> str:
        """An episode's first prompt as plain text, without experience: the system message and the first
        user message (released ``initial_task_prompt``: the env's instruction and first observation)."""
        return f"{system.strip()}\n\n{self.user_text(task_prompt, (), obs, '', reply)}".strip()

    def build(self, system: str, user: str, prefill: str | None = None) -> list[int]:
        """Token ids of ``system`` + ``user`` messages, the generation prompt and the prefill
        (``prefill``, default the builder's own)."""
        return self.encode([{"role": "system", "content": system}, {"role": "user", "content": user}], prefill)

    def encode(self, messages: Sequence[dict[str, str]], prefill: str | None = None) -> list[int]:
        """Token ids of a chat, the generation prompt and the prefill."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text + (self.prefill if prefill is None else prefill),
                                     add_special_tokens=False)

    def turn(self, chat: list[dict[str, str]], system: str, task_prompt: str,
             history: Sequence[tuple[str, str]], obs: str, guidance: str, instruction: str,
             prefill: str | None = None, turn_guidance: str = "",
             previous: tuple[Sequence[int], Sequence[int]] | None = None) -> list[int]:
        """Prompt ids of an episode's next turn; ``chat`` is the episode's message list (empty before
        its first turn), extended in place with the user message of this turn (``multiturn``: call
        :meth:`reply` with the actor's reply afterwards).  ``turn_guidance`` (experience retrieved for
        this turn only) is put before the observation of this turn's user message.

        ``previous`` is the (prompt ids, response ids) of the episode's last turn.  With the
        ``multiturn`` layout the new prompt is built token-in, token-out: those ids unchanged, then the
        template's close of the actor's message (less what the actor already sampled of it, e.g. its
        end-of-turn token), the new user message and the generation prompt, newly encoded
        (:meth:`continuation`).  The actor's earlier replies are never decoded and re-encoded, so the
        ids it sees later are the ids it sampled and the episode's prompts are append-only.  Only a
        chat template that does not render a new message as an append (:meth:`continuation` gives
        ``None``) re-encodes the whole chat.
        """
        if turn_guidance.strip():
            obs = f"{turn_guidance.strip()}\n\n{obs.strip()}"
        if self.layout == "window":
            chat[:] = [{"role": "system", "content": self.system_text(system, guidance)},
                       {"role": "user", "content": self.user_text(task_prompt, history, obs, guidance, instruction)}]
        elif not chat:
            chat += [{"role": "system", "content": self.system_text(system, guidance)},
                     {"role": "user", "content": self.user_text(task_prompt, (), obs, guidance, instruction)}]
        else:
            user = f"{obs.strip()}\n\n{instruction}"
            if previous is not None and chat[-1]["role"] == "assistant":
                ids = self.continuation(chat, user, previous[1], prefill)
                if ids is not None:
                    chat.append({"role": "user", "content": user})
                    return list(previous[0]) + list(previous[1]) + ids
            chat.append({"role": "user", "content": user})
        return self.encode(chat, prefill)

    #: a private-use character standing in for the actor's reply when the template's own pieces are
    #: rendered (no chat template alters it)
    _REPLY_MARK = "\ue000"

    def continuation(self, chat: Sequence[dict[str, str]], user: str, response_ids: Sequence[int],
                     prefill: str | None = None) -> list[int] | None:
        """Ids that follow an actor reply ``response_ids`` (the last message of ``chat``, an assistant
        message) to make the next prompt: the template's close of that message, the user message
        ``user``, the generation prompt and the prefill.

        The template's pieces are found by rendering the chat with a stand-in reply: ``head`` (up
        to the generation prompt), ``closed`` (the stand-in reply closed) and ``next`` (plus the new
        user message and a generation prompt).  The close's leading ids that the reply already ends
        with (a sampled end-of-turn token) are not repeated.

        Returns ``None`` when the template does not render these as appends (``closed`` not extending
        ``head`` + stand-in, or ``next`` not extending ``closed``), e.g. templates that rewrite
        earlier assistant messages: the caller then encodes the whole chat.
        """
        before = [dict(m) for m in chat[:-1]]
        mark = {"role": "assistant", "content": self._REPLY_MARK}
        render = self.tokenizer.apply_chat_template
        head = render(before, add_generation_prompt=True, tokenize=False)
        closed = render(before + [mark], add_generation_prompt=False, tokenize=False)
        nxt = render(before + [mark, {"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        if not closed.startswith(head + self._REPLY_MARK) or not nxt.startswith(closed):
            return None
        close = closed[len(head) + len(self._REPLY_MARK):]
        close_ids = self.tokenizer.encode(close, add_special_tokens=False) if close else []
        sampled = list(response_ids)
        k = min(len(close_ids), len(sampled))
        while k and sampled[-k:] != close_ids[:k]:
            k -= 1
        rest = nxt[len(closed):] + (self.prefill if prefill is None else prefill)
        return close_ids[k:] + self.tokenizer.encode(rest, add_special_tokens=False)

    def reply(self, chat: list[dict[str, str]], reply: str) -> None:
        """Append the actor's reply (prefill included) to a ``multiturn`` chat."""
        if self.layout == "multiturn":
            chat.append({"role": "assistant", "content": reply})
