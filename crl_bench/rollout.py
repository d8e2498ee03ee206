"""The rollout loop: many env instances stepped together, one batched generate per turn.

Data path: env (text obs) -> prompt -> engine.generate -> parse/step -> :class:`Trajectory`.  Each turn
is stored as its own (prompt ids, response ids) pair, so the actor's loss covers exactly the tokens it
generated (the response) and nothing the environment wrote.  The turn prompts and their two layouts
(``window``, ``multiturn``) are :class:`~crl_bench.prompts.PromptBuilder`'s (:mod:`crl_bench.prompts`).

Two optional hooks of the experience track ride on the same loop: a per-turn retrieval before each
step of chosen episodes (``turn_guide``; released turn-based integration) and an in-episode search
tool (:class:`SearchTool`): a reply holding ``<knowledge_search>question</knowledge_search>`` is
answered by the tool instead of being sent to the env, and takes one of the episode's actions.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crl_bench.env_api import TextEnv, feedback_of
from crl_bench.env_pool import EnvPool
from crl_bench.experience.types import RetrievalRecord
from crl_bench.llm.base import Engine, Generation, SamplingParams
from crl_bench.prompts import PromptBuilder

if TYPE_CHECKING:
    from crl_bench.experience.extractor import Extraction


@dataclass
class Turn:
    """One actor decision.

    Attributes:
        prompt_ids: prompt token ids (length P), everything the actor saw, including the prefill.
        response_ids: generated token ids (length R); the only tokens that receive gradient.
        logprobs: behaviour log-prob of each response token (length R), the "old" log-probs of PPO.
        action: canonical action the env accepted, or ``None`` when invalid.
        invalid: the reply did not parse to a legal action.
        reward: env reward of this step.
        observation: the observation text the actor answered (for the extractor's record).
        reply: the actor's reply text, prefill included.
        entropy: entropy (nats) of the actor's unconstrained next-token distribution at each response
            token (length R; empty when the engine does not report it, e.g. vLLM).
        sampling_entropy: entropy (nats) of the distribution each response token was drawn from
            (constrained decoding's mask and the sampling settings applied; length R or empty).
        tool: the reply was a search-tool call (answered by the tool; the env was not stepped).
        experience_ids, retrieval, query: with turn-level retrieval, the ids of the entries retrieved
            before this turn, the guide's record of that retrieval and the retrieval query of this
            turn's observation (else empty / ``None`` / "").
        free_prompt_ids: the prompt this turn would have had without experience (the episode's
            guidance and this turn's retrieved text left out, all else equal), kept only when the
            runner records them (:attr:`RolloutRunner.free_prompts`) and the prompt carried
            experience; ``None`` otherwise (internalisation, trainer/internalise.py).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    action: str | None
    invalid: bool
    reward: float
    observation: str = ""
    reply: str = ""
    entropy: list[float] = field(default_factory=list)
    sampling_entropy: list[float] = field(default_factory=list)
    tool: bool = False
    experience_ids: list[int] = field(default_factory=list)
    retrieval: RetrievalRecord | None = None
    query: str = ""
    free_prompt_ids: list[int] | None = None

    @property
    def action_mask(self) -> list[int]:
        """0 for each prompt token, 1 for each response token (length P + R)."""
        return [0] * len(self.prompt_ids) + [1] * len(self.response_ids)


@dataclass
class EpisodeSpec:
    """What to roll out: env, task, and which group (and subgroup) the episode belongs to.

    ``guidance`` is extra text put in the prompt; with ``retrieve`` set, the runner's ``guide``
    callback supplies guidance (retrieved experience) after the reset, from the task and the first
    observation; with ``turn_retrieve`` set, the runner's ``turn_guide`` is asked before every turn
    with the current observation; with ``tool`` set, the episode may call the runner's search tool.
    ``meta`` is carried into the trajectory untouched.  ``query``, when set, is what the ``guide``
    callback retrieves with instead of the episode's own retrieval query (the ``shuffled`` memory
    control of evaluation: another task's query); the trajectory keeps its own query.  ``max_steps``,
    when above 0, is the episode's action limit in place of the env's (an evaluation protocol's,
    ``eval.max_steps``).
    """

    env_id: str
    task: int
    group_id: int = 0
    subgroup: str = "free"
    guidance: str = ""
    retrieve: bool = False
    meta: dict = field(default_factory=dict)
    turn_retrieve: bool = False
    tool: bool = False
    query: str = ""
    max_steps: int = 0

    def reset_options(self) -> dict[str, int]:
        """The ``options`` of the env reset that starts this episode: the task and, when set, the limit."""
        return {"task": self.task, **({"max_steps": self.max_steps} if self.max_steps else {})}


@dataclass
class Guidance:
    """What the ``guide`` callback gives one guided episode.

    Attributes:
        text: the experience text put into the actor's prompt ("" shows nothing).
        entry_ids: ids of the bank entries retrieved for the episode (kept even when ``text`` is
            empty, e.g. when the actor rejected them).
        record: what the retrieval gave, recorded when it was made (the experience track credits the
            entries' writers from it later), or ``None`` when nothing was retrieved.
    """

    text: str = ""
    entry_ids: list[int] = field(default_factory=list)
    record: RetrievalRecord | None = None


@dataclass
class ToolCall:
    """One search-tool call of an episode.

    Attributes:
        turn: 0-based index of the turn whose reply made the call.
        query: the question the actor asked.
        answer: the text the tool gave back.
        entry_ids: ids of the bank entries retrieved for the question.
        record: the extractor's sample that wrote the answer (the experience track credits it with
            the episode's outcome), or ``None`` when no extractor sample answered.
    """

    turn: int
    query: str
    answer: str
    entry_ids: list[int] = field(default_factory=list)
    record: Extraction | None = None


@dataclass
class Trajectory:
    """A finished episode.

    Attributes:
        env_id, task, group_id, subgroup, meta: from the :class:`EpisodeSpec`.
        turns: the actor's decisions in order.
        reward: sum of step rewards (the outcome reward for our sparse envs).
        success: the env's ``info["success"]`` at the end.
        steps: actions taken (valid or not).
        invalid_actions: replies that did not parse to a legal action.
        terminated / truncated: how the episode ended (truncated = step limit, or the context).
        context_full: the episode ended because its next prompt filled the actor's context
            (:class:`RolloutRunner` ``max_context_tokens``); ``truncated`` is then set too.
        error: set when the env raised and the episode was ended as a failure.
        task_prompt: the env's one-line goal.
        guidance: the guidance text the actor's prompts carried ("" for experience-free episodes).
        experience_ids: ids of the experience entries that guided the episode.
        final_obs: the observation after the last action.
        query: the env's retrieval query of the episode (:meth:`TextEnv.retrieval_query`).
        key: what the entries distilled from the episode are keyed by when the env keys them itself
            (:meth:`TextEnv.entry_key`, read when the episode ends); ``""``: :attr:`query`.
        retrieval: the guide's record of the episode's retrieval (:attr:`Guidance.record`), or None.
        initial_prompt: the episode's first prompt as text, system message and first user message
            (the first observation included, experience left out): what the actor-critic judge is
            shown as the task (released ``initial_task_prompt``).
        tool_calls: the episode's search-tool calls, in order.
    """

    env_id: str
    task: int
    group_id: int
    subgroup: str
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    steps: int = 0
    invalid_actions: int = 0
    terminated: bool = False
    truncated: bool = False
    context_full: bool = False
    error: str = ""
    meta: dict = field(default_factory=dict)
    task_prompt: str = ""
    guidance: str = ""
    experience_ids: list[int] = field(default_factory=list)
    final_obs: str = ""
    query: str = ""
    key: str = ""
    retrieval: RetrievalRecord | None = None
    initial_prompt: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def response_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)



@dataclass
class RolloutStats:
    """Timing of one :meth:`RolloutRunner.collect` call (seconds, tokens)."""

    generate_s: float = 0.0
    env_s: float = 0.0
    wall_s: float = 0.0
    generated_tokens: int = 0
    generate_calls: int = 0
    retrieve_s: float = 0.0


GuideFn = Callable[[list[tuple[str, str, str]]], list[Guidance]]

TOOL_OPEN, TOOL_CLOSE = "<knowledge_search>", "</knowledge_search>"
_TOOL_CALL = re.compile(r"<\s*knowledge_search\s*>(.*?)<\s*/\s*knowledge_search\s*>", re.IGNORECASE | re.DOTALL)

TOOL_INSTRUCTION = """\
You may consult a notebook of knowledge from earlier episodes when you are unsure or stuck: write \
{open}your question{close} instead of an action. Describe what you see, what you have tried and what \
you need to know; the answer comes back as your next observation. Each question uses up one of your \
actions, and you may ask at most {uses} times in this episode."""
"""The search tool's instruction, added to the first observation of an episode that has the tool
(this project's wording; released: the tool's instruction appended to the reset observation)."""

TOOL_SPENT = "You have asked all the questions you may ask in this episode; reply with an action from now on."


def tool_query(reply: str) -> str | None:
    """The question of a search-tool call in ``reply`` (the first complete
    ``<knowledge_search>...</knowledge_search>``, whitespace collapsed), or ``None``."""
    m = _TOOL_CALL.search(reply or "")
    return " ".join(m.group(1).split()) if m else None


@dataclass
class SearchTool:
    """The in-episode knowledge-search tool (released ``knowledge_search_and_ask``).

    Attributes:
        answer: ``answer([(env_id, question)]) -> [ToolCall-like (answer, entry_ids, record)]``:
            called once per turn with every question asked in that turn; returns one
            ``(answer text, entry ids, record)`` per question.
        max_uses: calls allowed per episode (released 2); after that a reply is sent to the env as
            an action (released: the tool no longer parses it).
    """

    answer: Callable[[list[tuple[str, str]]], list[tuple[str, list[int], Extraction | None]]]
    max_uses: int = 2

    def instruction(self) -> str:
        return TOOL_INSTRUCTION.format(open=TOOL_OPEN, close=TOOL_CLOSE, uses=self.max_uses)


class RolloutRunner:
    """Steps many episodes together, one batched ``generate`` per turn, until all are done.

    At most ``max_concurrent`` episodes are live at once.  With ``continuous`` (the default) the
    batch is continuous: when an episode ends (or fails), the next pending spec is reset and joins
    the live set at the next turn, so the live batch stays full until the queue runs dry; without
    it, specs run in waves of ``max_concurrent`` and a wave waits for its slowest episode (the
    rollout before continuous batching; ``crl-bench bench eval`` compares the two).  A batch that
    fits ``max_concurrent`` is one wave either way.

    Args:
        engine: generation engine.
        prompt_builder: builds turn prompts.
        pool: env instances.
        sampling: sampling settings.
        constrained: restrict replies to admissible actions for envs with a closed action set.
        max_concurrent: at most this many episodes live at once (0 = all). Bounds the env instances
            (ALFWorld: worker processes) a batch needs.
        max_context_tokens: the most tokens a prompt and its reply may hold together (0 = no limit).
            As released (``TrajEnvManager.make_decision``): a reply gets at most what the prompt leaves
            of it, and an episode whose prompt holds ``max_context_tokens`` or more ends before the
            turn, truncated, with ``context_full`` set.
        continuous: continuous batching (above); ``False``: waves.

    Attribute ``free_prompts`` (default ``False``): also record, for each turn whose prompt carried
    experience, the prompt it would have had without it (:attr:`Turn.free_prompt_ids`: built by the same
    prompt builder with no guidance; with the ``multiturn`` layout each later prompt extends the free
    prompt before it, as the real prompts extend theirs).
    """

    def __init__(self, engine: Engine, prompt_builder: PromptBuilder, pool: EnvPool,
                 sampling: SamplingParams, constrained: bool = True, max_concurrent: int = 0,
                 max_context_tokens: int = 0, continuous: bool = True) -> None:
        self.engine = engine
        self.prompts = prompt_builder
        self.pool = pool
        self.sampling = sampling
        self.constrained = constrained
        self.max_concurrent = max(0, int(max_concurrent))
        self.max_context_tokens = max(0, int(max_context_tokens))
        self.continuous = bool(continuous)
        self.free_prompts = False
        self.last_stats = RolloutStats()

    def _fit_reply(self, gen: Generation, room: int) -> Generation:
        """``gen`` cut to its first ``room`` tokens (the reply a budget of ``room`` new tokens gives:
        the first tokens of a sample do not depend on how many follow), ``finish_reason`` "length";
        ``gen`` itself when it fits."""
        if len(gen.response_ids) <= room:
            return gen
        ids = list(gen.response_ids[:room])
        extra = {k: list(v[:room]) if isinstance(v, list) else v for k, v in gen.extra.items()}
        return Generation(gen.prompt_ids, ids, list(gen.logprobs[:room]),
                          self.prompts.tokenizer.decode(ids, skip_special_tokens=True), "length", extra)

    def _allowed(self, env: TextEnv) -> list[str] | None:
        if not self.constrained:
            return None
        actions = env.admissible_actions()
        if actions is None:
            return None
        prefix = "" if "<answer>" in self.prompts.prefill.lower() else "<answer>"
        return [f"{prefix}{a}</answer>" for a in actions]

    def collect(self, specs: Sequence[EpisodeSpec], sampling: SamplingParams | None = None,
                progress: Callable[[int], None] | None = None, guide: GuideFn | None = None,
                prefetch: Sequence[EpisodeSpec] | None = None, turn_guide: GuideFn | None = None,
                tool: SearchTool | None = None) -> list[Trajectory]:
        """Roll out every spec to the end; returns trajectories in the order of ``specs``.

        An env that raises during ``reset``/``step`` ends its episode as a failure (``error`` set),
        the env is discarded and replaced on the next acquire; the other episodes go on.
        ``progress(n)`` is called with the number of episodes ended (failed ones included) since the
        last call.  ``guide(requests)`` is called once per turn at which episodes join (all of them at
        the first turn when every spec fits ``max_concurrent``), after their resets, with
        ``(env_id, first task prompt, retrieval query)`` of each joining spec that has ``retrieve``
        set, and returns a :class:`Guidance` for each, in order. ``turn_guide`` is called the same way
        before every turn, for the live episodes whose spec has ``turn_retrieve`` set, with the
        retrieval query of the current observation; its guidance is recorded on the :class:`Turn`
        (and shown in that turn's prompt when its text is not empty). ``tool`` answers the search-tool
        calls of episodes whose spec has ``tool`` set (see :class:`SearchTool`); a call is a turn that
        does not step the env, and an episode whose turns reach the env's ``max_steps`` ends there
        (truncated). Pending specs are handed to :meth:`EnvPool.prefetch` (at most ``max_concurrent``
        ahead of the live ones) and ``prefetch`` (the next batch's specs) once the last spec has
        joined, so slow resets overlap generation.
        """
        hooks = {"guide": guide, "turn_guide": turn_guide, "tool": tool}
        return self.collect_streams([(specs, hooks)], sampling, progress, prefetch)[0]

    def collect_streams(self, streams: Sequence[tuple[Sequence[EpisodeSpec], dict[str, Any]]],
                        sampling: SamplingParams | None = None, progress: Callable[[int], None] | None = None,
                        prefetch: Sequence[EpisodeSpec] | None = None,
                        stream_done: Callable[[int, list[Trajectory]], None] | None = None,
                        episode_done: Callable[[int, int, Trajectory], None] | None = None,
                        ) -> list[list[Trajectory]]:
        """Roll out several streams of specs as one queue (:meth:`collect` per stream, batched together).

        Args:
            streams: ``(specs, hooks)`` pairs; ``hooks`` holds this stream's ``guide``, ``turn_guide``
                and ``tool`` (each optional, as in :meth:`collect`), e.g. one stream per eval mode.
                The queue is the streams' specs in order; each hook is called only with its own
                stream's episodes.
            sampling, progress, prefetch: as in :meth:`collect`.
            stream_done: called as ``stream_done(k, trajectories of stream k)`` as soon as the last
                episode of stream ``k`` has ended (while the other streams may still run).
            episode_done: called as ``episode_done(k, i, trajectory)`` as soon as episode ``i`` of
                stream ``k`` (its place in that stream's specs) has ended, failed ones included.

        Returns one list of trajectories per stream, each in the order of its specs.

        Raises:
            ValueError: a hook other than ``guide``, ``turn_guide``, ``tool``.
        """
        sampling = sampling or self.sampling
        hooks = []
        for _, h in streams:
            unknown = set(h) - {"guide", "turn_guide", "tool"}
            if unknown:
                raise ValueError(f"unknown rollout hooks {sorted(unknown)}; known: guide, turn_guide, tool")
            hooks.append(h)
        queue = [(k, s) for k, (specs, _) in enumerate(streams) for s in specs]
        eps = [_Episode(i, s, k, Trajectory(s.env_id, s.task, s.group_id, s.subgroup, meta=dict(s.meta)),
                        has_tool=hooks[k].get("tool") is not None and s.tool) for i, (k, s) in enumerate(queue)]
        n = self.max_concurrent or len(eps)
        out: list[list[Trajectory]] = [[] for _ in streams]
        for e in eps:
            out[e.stream].append(e.traj)
        left = [len(specs) for specs, _ in streams]
        first = [sum(left[:k]) for k in range(len(streams))]       # queue index of each stream's first spec

        def ended(e: _Episode) -> None:
            if episode_done is not None:
                episode_done(e.stream, e.index - first[e.stream], e.traj)
            if progress:
                progress(1)
            left[e.stream] -= 1
            if left[e.stream] == 0 and stream_done is not None:
                stream_done(e.stream, out[e.stream])

        for k in (k for k, count in enumerate(left) if count == 0 and stream_done is not None):
            stream_done(k, [])
        stats = RolloutStats()
        t_start = time.perf_counter()
        live: list[_Episode] = []
        joined = ahead = 0              # eps[:joined] have joined; eps[joined:ahead] have prefetched resets
        handed_on = False

        def after_resets() -> None:     # keep the next specs' resets under way
            nonlocal ahead, handed_on
            if joined < len(eps):
                start, ahead = max(ahead, joined), min(len(eps), joined + n)
                if start < ahead:
                    self.pool.prefetch([e.spec for e in eps[start:ahead]])
            elif prefetch and not handed_on:
                self.pool.prefetch(prefetch)
                handed_on = True

        while True:
            room = (n - len(live)) if (self.continuous or not live) else 0
            if room > 0 and joined < len(eps):
                joining = eps[joined:joined + room]
                joined += len(joining)
                live += self._join(joining, hooks, stats, ended, after_resets)
                live.sort(key=lambda e: e.index)
            if not live:
                if joined >= len(eps):
                    break
                continue
            live = self._turn(live, hooks, sampling, stats, ended)
        stats.wall_s = time.perf_counter() - t_start
        self.last_stats = stats
        return out

    def _join(self, joining: Sequence[_Episode], hooks: Sequence[dict[str, Any]], stats: RolloutStats,
              ended: Callable[[_Episode], None], after_resets: Callable[[], None]) -> list[_Episode]:
        """Reset the joining episodes' envs (all started, then waited for: workers reset in parallel),
        call ``after_resets`` (the prefetch of later resets), set up their trajectories and ask each
        stream's ``guide`` for its joining episodes; returns the episodes whose reset succeeded."""
        t0 = time.perf_counter()
        started = []
        for e in joining:
            env, pending = self.pool.acquire_for(e.spec.env_id, e.spec.task, e.spec.max_steps)
            e.env = env
            try:
                if not pending:
                    env.reset_async(options=e.spec.reset_options())
                started.append(e)
            except Exception as err:  # noqa: BLE001 - an env crash fails the episode, never the run
                self._fail(e, err, ended)
        live = []
        for e in started:
            try:
                e.obs, _ = e.env.reset_wait()
                live.append(e)
            except Exception as err:  # noqa: BLE001 - any env failure loses that episode only (restarted worker)
                self._fail(e, err, ended)
        after_resets()
        for e in live:
            env, tr = e.env, e.traj
            tr.task_prompt = env.task_prompt()
            tr.query = env.retrieval_query(e.obs)
            tr.guidance = e.spec.guidance
            tr.initial_prompt = self.prompts.task_text(env.system_prompt, tr.task_prompt, e.obs,
                                                       env.reply_format.instruction)
            if e.has_tool:
                e.obs = f"{e.obs.rstrip()}\n\n{hooks[e.stream]['tool'].instruction()}"
        stats.env_s += time.perf_counter() - t0
        for k, h in enumerate(hooks):
            guide = h.get("guide")
            wanted = [e for e in live if e.stream == k and e.spec.retrieve]
            if guide is None or not wanted:
                continue
            t0 = time.perf_counter()
            answers = guide([(e.spec.env_id, e.traj.initial_prompt, e.spec.query or e.traj.query) for e in wanted])
            for e, g in zip(wanted, answers):
                e.traj.guidance = "\n\n".join(x for x in (e.spec.guidance, g.text) if x)
                e.traj.experience_ids = list(g.entry_ids)
                e.traj.retrieval = g.record
            stats.retrieve_s += time.perf_counter() - t0
        return live

    def _turn(self, live: list[_Episode], hooks: Sequence[dict[str, Any]], sampling: SamplingParams,
              stats: RolloutStats, ended: Callable[[_Episode], None]) -> list[_Episode]:
        """One turn of every live episode; returns the episodes still live after it, in order."""
        turn_found: dict[int, tuple[str, Guidance]] = {}
        for k, h in enumerate(hooks):
            turn_guide = h.get("turn_guide")
            asking = [e for e in live if e.stream == k and e.spec.turn_retrieve]
            if turn_guide is None or not asking:
                continue
            t0 = time.perf_counter()
            queries = [e.env.retrieval_query(e.obs) for e in asking]
            found = turn_guide([(e.spec.env_id, e.traj.initial_prompt, q) for e, q in zip(asking, queries)])
            turn_found.update({e.index: (q, g) for e, q, g in zip(asking, queries, found)})
            stats.retrieve_s += time.perf_counter() - t0
        # a stream whose episodes may still call the search tool stops its replies at the call's close
        tool_open = {e.stream for e in live if e.has_tool and e.tool_uses < hooks[e.stream]["tool"].max_uses}
        prompt_ids, allowed, prefills, free_ids = {}, {}, {}, {}
        budget, stops = sampling.max_new_tokens, list(sampling.stop)
        for e in live:
            env, tr = e.env, e.traj
            fmt = env.reply_format
            prefills[e.index] = self.prompts.prefill if fmt.prefill is None else fmt.prefill
            turn_text = turn_found[e.index][1].text if e.index in turn_found else ""
            last = tr.turns[-1] if tr.turns else None
            free = self.free_prompts and bool(tr.guidance or turn_text.strip())
            before = list(e.chat) if free else []
            prompt_ids[e.index] = self.prompts.turn(e.chat, env.system_prompt, tr.task_prompt, e.history, e.obs,
                                                    tr.guidance, fmt.instruction, prefills[e.index],
                                                    turn_guidance=turn_text,
                                                    previous=(last.prompt_ids, last.response_ids) if last else None)
            if free:
                free_ids[e.index] = self._free_prompt(e, before, prompt_ids[e.index], prefills[e.index], turn_text)
            allowed[e.index] = None if e.has_tool else self._allowed(env)
            budget = max(budget, fmt.min_new_tokens)
            stops += [x for x in fmt.stop if x not in stops]
        if self.max_context_tokens:
            still = []
            for e in live:                  # no room for a reply: the episode ends before the turn
                if len(prompt_ids[e.index]) >= self.max_context_tokens:
                    e.traj.truncated = e.traj.context_full = True
                    e.traj.final_obs = e.obs
                    self._finish(e, ended)
                else:
                    still.append(e)
            live = still
            if not live:
                return []
        gens: dict[int, Generation] = {}
        groups = [[e for e in live if e.stream not in tool_open], [e for e in live if e.stream in tool_open]]
        for group, tool_stop in zip(groups, (False, True)):
            if not group:
                continue
            group_stops = stops + [TOOL_CLOSE] if tool_stop and TOOL_CLOSE not in stops else stops
            same = (budget, tuple(group_stops)) == (sampling.max_new_tokens, tuple(sampling.stop))
            turn_sampling = sampling if same else \
                dataclasses.replace(sampling, max_new_tokens=budget, stop=tuple(group_stops))
            t0 = time.perf_counter()
            ids = [prompt_ids[e.index] for e in group]
            if getattr(self.engine, "wants_chats", False):     # a chat server reads the messages, not the ids
                out = self.engine.generate(ids, turn_sampling, [allowed[e.index] for e in group],
                                           chats=[list(e.chat) for e in group])
            else:
                out = self.engine.generate(ids, turn_sampling, [allowed[e.index] for e in group])
            if self.max_context_tokens:
                out = [self._fit_reply(g, self.max_context_tokens - len(p)) for g, p in zip(out, ids)]
            stats.generate_s += time.perf_counter() - t0
            stats.generate_calls += 1
            gens.update({e.index: g for e, g in zip(group, out)})
        t0 = time.perf_counter()
        still, sent, calls = [], [], []
        for e in live:                      # send every action, then wait: workers step in parallel
            gen = gens[e.index]
            stats.generated_tokens += len(gen.response_ids)
            reply = prefills[e.index] + gen.text
            self.prompts.reply(e.chat, reply)
            tool = hooks[e.stream].get("tool")
            query = tool_query(reply) if e.has_tool and e.tool_uses < tool.max_uses else None
            if query is not None:
                calls.append((e, gen, reply, query))
                continue
            try:
                e.env.step_async(reply)
                sent.append((e, gen, reply))
            except Exception as err:  # noqa: BLE001 - any env failure loses that episode only (restarted worker)
                self._fail(e, err, ended)
        for k, h in enumerate(hooks):
            mine = [c for c in calls if c[0].stream == k]
            if not mine:
                continue
            tool = h["tool"]
            t1 = time.perf_counter()
            results = tool.answer([(e.spec.env_id, q) for e, _, _, q in mine])
            stats.retrieve_s += time.perf_counter() - t1
            for (e, gen, reply, query), (answer, entry_ids, record) in zip(mine, results):
                tr = e.traj
                e.tool_uses += 1
                tr.tool_calls.append(ToolCall(len(tr.turns), query, answer, list(entry_ids), record))
                self._record_turn(tr, gen, None, False, 0.0, e.obs, reply, turn_found.get(e.index), tool=True,
                                  free=free_ids.get(e.index))
                tr.steps += 1
                shown = f"Search results: {answer}"
                if e.tool_uses >= tool.max_uses:
                    shown += f"\n\n{TOOL_SPENT}"
                e.history.append((f"(search) {query[:40]}", shown))
                # the window layout rebuilds each prompt from the current observation, so the
                # state is repeated after the answer; a multi-turn chat still holds it
                e.obs = shown if self.prompts.layout == "multiturn" else f"{shown}\n\n{e.obs.strip()}"
                if self._out_of_turns(e.env, tr):
                    tr.truncated, tr.final_obs = True, e.obs
                    self._finish(e, ended)
                else:
                    still.append(e)
        for e, gen, reply in sent:
            try:
                o, r, term, trunc, info = e.env.step_wait()
            except Exception as err:  # noqa: BLE001 - any env failure loses that episode only (restarted worker)
                self._fail(e, err, ended)
                continue
            tr = e.traj
            self._record_turn(tr, gen, info.get("action"), bool(info.get("invalid_action")), float(r), e.obs,
                              reply, turn_found.get(e.index), free=free_ids.get(e.index))
            tr.reward += float(r)
            tr.steps = int(info.get("steps", len(tr.turns))) + e.tool_uses
            tr.invalid_actions = int(info.get("invalid_actions", 0))
            tr.success = bool(info.get("success", False))
            label = info.get("action") or f"(invalid) {gen.text.strip()[:40]}"
            e.history.append((label, feedback_of(o)))
            e.obs = o
            if not (term or trunc) and self._out_of_turns(e.env, tr):
                trunc = True
            if term or trunc:
                tr.terminated, tr.truncated = bool(term), bool(trunc)
                tr.final_obs = o
                self._finish(e, ended)
            else:
                still.append(e)
        stats.env_s += time.perf_counter() - t0
        keep = {e.index for e in still}
        return [e for e in live if e.index in keep]

    def _free_prompt(self, e: _Episode, before: list[dict[str, str]], real: list[int], prefill: str,
                     turn_text: str) -> list[int] | None:
        """The prompt of ``e``'s coming turn without experience (:attr:`Turn.free_prompt_ids`): ``before``
        is the episode's chat before this turn's prompt was built, ``real`` that prompt.  ``window``
        layout, or a first turn: the builder's prompt with no guidance.  ``multiturn``: the last turn's
        free prompt and reply, then what the real prompt appends to the real ones (rebuilt without
        this turn's retrieved text where it had one); ``None`` where the last turn has no free prompt or
        the template re-encodes the whole chat (such an episode is not internalised)."""
        env, tr = e.env, e.traj
        fmt = env.reply_format
        if self.prompts.layout == "window" or not tr.turns:
            return self.prompts.turn([], env.system_prompt, tr.task_prompt, e.history, e.obs, "", fmt.instruction,
                                     prefill)
        last = tr.turns[-1]
        head = list(last.prompt_ids) + list(last.response_ids)
        base = last.free_prompt_ids if last.free_prompt_ids is not None else \
            (list(last.prompt_ids) if not tr.guidance and not last.experience_ids else None)
        if base is None or real[:len(head)] != head:
            return None
        if not turn_text.strip():
            return base + list(last.response_ids) + real[len(head):]
        tail = self.prompts.continuation(before, f"{e.obs.strip()}\n\n{fmt.instruction}", last.response_ids, prefill)
        return None if tail is None else base + list(last.response_ids) + tail

    @staticmethod
    def _record_turn(tr: Trajectory, gen: Any, action: str | None, invalid: bool, reward: float, obs: str,
                     reply: str, found: tuple[str, Guidance] | None, tool: bool = False,
                     free: list[int] | None = None) -> None:
        query, g = found if found is not None else ("", None)
        tr.turns.append(Turn(gen.prompt_ids, gen.response_ids, gen.logprobs, action, invalid, reward, obs, reply,
                             list(gen.extra.get("entropy", ())), list(gen.extra.get("sampling_entropy", ())),
                             tool=tool, experience_ids=list(g.entry_ids) if g is not None else [],
                             retrieval=g.record if g is not None else None, query=query,
                             free_prompt_ids=list(free) if free is not None else None))

    @staticmethod
    def _out_of_turns(env: TextEnv, tr: Trajectory) -> bool:
        """Search-tool calls take actions too: an episode that made any ends once its turns reach the
        env's action limit (the env itself only counts the actions it was sent)."""
        limit = int(getattr(env, "episode_max_steps", 0) or getattr(env, "max_steps", 0) or 0)
        return bool(tr.tool_calls) and limit > 0 and len(tr.turns) >= limit

    def _finish(self, e: _Episode, ended: Callable[[_Episode], None]) -> None:
        if getattr(e.env, "has_entry_key", False):      # the env keys the episode's entries (MiniHack raw)
            e.traj.key = e.env.entry_key(bool(e.traj.turns) and not e.traj.turns[0].tool) or ""
        self.pool.release(e.spec.env_id, e.env)
        e.env = None
        ended(e)

    def _fail(self, e: _Episode, err: Exception, ended: Callable[[_Episode], None]) -> None:
        e.traj.error = f"{type(err).__name__}: {err}"
        e.traj.terminated = True
        e.traj.success = False
        if e.env is not None:
            self.pool.discard(e.env)
            e.env = None
        ended(e)


@dataclass
class _Episode:
    """A running episode of :meth:`RolloutRunner.collect_streams`: queue place, spec, stream, trajectory,
    env, observation, (action, feedback) history, ``multiturn`` chat, search-tool calls made."""

    index: int
    spec: EpisodeSpec
    stream: int
    traj: Trajectory
    has_tool: bool = False
    env: TextEnv | None = None
    obs: str = ""
    history: list[tuple[str, str]] = field(default_factory=list)
    chat: list[dict[str, str]] = field(default_factory=list)
    tool_uses: int = 0
