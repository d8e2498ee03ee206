"""The NLE adapter: :class:`MiniHackTextEnv`, the base of the MiniHack text envs.

It wraps a MiniHack gymnasium env (minihack 1.0.2 on NLE 1.3.0, the NetHack Learning Environment):
the game runs in NetHack itself; this class seeds it per task, names the actions, renders each
observation as text (:mod:`.render`) and maps the game's end status to the reward.

Facts used (read in the upstream sources named, and measured on this machine):

* ``nle/env/base.py`` / ``nle/env/tasks.py`` (``NetHackStaircase.StepStatus``): ``end_status`` is
  ``-1`` ABORTED (NLE's own step limit, returned with ``terminated=True``), ``0`` RUNNING, ``1``
  DEATH (any game over), ``2`` TASK_SUCCESSFUL (standing on the stairs down).
* ``nle/env/base.py`` ``seed()``: ``reset(seed=...)`` does not seed NetHack;
  ``env.unwrapped.seed(core, disp, reseed=False)`` sets the RNGs used by the *next* reset. We call it
  before every reset with seeds derived from the task id, so a task id always gives the same level.
* NLE returns views into buffers it reuses, and after the last step of a game ``chars``/``glyphs``/
  ``blstats`` are blank (zeros). Each frame is rendered to text right after the step and the last
  non-blank frame is kept, so the final observation still shows the map.
* ``gymnasium.make(id, max_episode_steps=N)`` only adds a ``TimeLimit`` wrapper; the NLE step limit
  is a constructor argument that ``make`` cannot forward. We pass it through a copy of the env spec
  (``inner_max_steps``, larger than ``max_steps`` by default) and add no ``TimeLimit``, so this
  class's ``max_steps`` (truncation) governs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from crl_bench.env_api import AnswerParser, TextEnv

from .actions import ACTION_NAMES, MOVE_ACTIONS, MOVE_ALIASES, action_names
from .prompts import MAP_SCENE, build_prompt
from .render import MapRenderer, decode_text

with warnings.catch_warnings():  # minihack imports pkg_resources (deprecated)
    warnings.simplefilter("ignore")
    import gymnasium as gym
    import minihack  # noqa: F401 - imported to register the MiniHack-* ids with gymnasium

#: NetHack's greeting at the start of a game ("Hello Agent, welcome to NetHack! You are a chaotic male human
#: Rogue.", "Salutations Agent, ..." for a Knight): not shown as the reset message
_WELCOME = "welcome to NetHack!"


def task_seeds(task: int) -> tuple[int, int]:
    """Deterministic ``(core, disp)`` NetHack seeds for ``task`` (splitmix64 of ``2 * task`` and
    ``2 * task + 1``, each cut to 63 bits; ``task`` is taken modulo 2**64)."""
    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
    t = int(task) & 0xFFFFFFFFFFFFFFFF
    return mix(2 * t), mix(2 * t + 1)


def join_messages(*parts: str) -> str:
    """The non-empty ``parts`` joined by blanks (``""`` if all are empty)."""
    return " ".join(p for p in parts if p)


class MiniHackTextEnv(TextEnv):
    """A MiniHack task with text observations and named actions (base of the MiniHack envs).

    Args:
        variant: the MiniHack gymnasium id to wrap (must be registered by ``import minihack``);
            defaults to the subclass's :attr:`default_variant`.
        view: ``"full"`` (seen map trimmed to its bounding box) or ``"crop"`` (9x9 around the agent);
            defaults to :attr:`default_view`.
        goal_offset: when the stairs are in view, also state where they are relative to the agent in
            compass terms (``The stairs down are 3 south and 2 east of you (direction:
            southeast).``), the kind of relative
            description BALROG's language observation of NetHack gives; off by default.  The ``cpu``
            preset turns it on (docs/learning.md).
        max_steps: actions per episode before truncation (see :class:`TextEnv`); default the class's
            :attr:`default_max_steps` (30; the 15x15 maze's 100).
        inner_max_steps: NLE's own step limit (reaching it ends the game as ABORTED, which this env
            reports as terminated with reward 0); default ``max(1000, 10 * max_steps)`` so that
            ``max_steps`` governs.
        render_mode: ``"ansi"`` (the observation text).
        query: the retrieval query (:meth:`retrieval_query`): ``"map"`` (default: ``Observation:``
            and the rendered observation) or ``"raw"`` (released ``build_memory_query``:
            ``Observation:`` and the text of the observation dictionary of :attr:`raw_keys`, as
            Python prints it; numpy abbreviates every array of more than 1,000 values, so the
            9x9 crops around the agent are most of what tells tasks apart).
        raw_key: with ``query="raw"``, what entries distilled from an episode are keyed by
            (:meth:`entry_key`): ``"released"`` (default) or ``"reset"`` (the episode's query, the
            reset observation). See :meth:`entry_key`.

    Raises:
        ValueError: unknown ``variant``, ``view``, ``query`` or ``raw_key``, or an NLE action without
            a name here.

    Reward 1.0 and ``success=True`` when NLE reports TASK_SUCCESSFUL (on the stairs down); 0.0
    otherwise. Death (end status 1) and NLE's step limit (-1) terminate with reward 0 and say so in the
    message. An instance can be reset any number of times; :meth:`close` frees the NetHack instance.

    The observation is the rendered map (:class:`~.render.MapRenderer`), then the lines of
    :meth:`_status_lines`, ``Last: <message>`` when there is a message, and ``Valid actions: ...``.
    ``info`` adds ``end_status`` (NLE's, 0 while running) and ``agent_xy`` (screen ``(x, y)``).

    Subclasses set the class attributes; the system prompt is built by
    :func:`~.prompts.build_prompt` from :attr:`rules_text` and :attr:`scene_text` (class attribute
    :attr:`system_prompt`, set for each subclass: for the default variant; an instance's: for its own
    variant).
    """

    env_id: ClassVar[str] = "minihack"
    #: MiniHack gymnasium id wrapped when no ``variant`` is given
    default_variant: ClassVar[str] = "MiniHack-Room-5x5-v0"
    default_view: ClassVar[str] = "full"
    #: actions per episode when the constructor is given none
    default_max_steps: ClassVar[int] = 30
    #: NLE action set handed to the MiniHack env (names: :data:`~.actions.ACTION_NAMES`)
    nle_actions: ClassVar[tuple[Any, ...]] = MOVE_ACTIONS
    #: NLE actions the env sends itself (keys answering NetHack's prompts), appended to the action set
    #: handed to MiniHack after :attr:`nle_actions`; never offered to the actor (:meth:`_send_key`)
    hidden_actions: ClassVar[tuple[Any, ...]] = ()
    action_aliases: ClassVar[dict[str, str]] = MOVE_ALIASES
    splits: ClassVar[dict[str, Sequence[int]]] = {"train": range(0, 1_000_000),
                                                   "eval": range(1_000_000, 1_000_500)}
    #: the task prompt (one line)
    goal_text: ClassVar[str] = "Reach the stairs down '>'."
    #: NLE observation keys needed besides chars, glyphs, blstats, message, screen_descriptions
    extra_obs_keys: ClassVar[tuple[str, ...]] = ()
    #: the observation dictionary of ``query="raw"``, keys in the released order: the released
    #: configuration's ``observation_keys`` of its MiniHack envs but Room (``multitask_env_tool.yaml``,
    #: MiniHackMaze and the others), plus ``chars``, which the released env appends
    #: (``roll/pipeline/agentic/env/minihack/env.py`` ~156-164)
    raw_keys: ClassVar[tuple[str, ...]] = ("glyphs", "blstats", "message", "inv_strs", "chars_crop",
                                           "glyphs_crop", "chars")
    #: the task's rules in the system prompt (after the shared intro, before the variant's notes)
    rules_text: ClassVar[str] = "Goal: step onto the stairs down '>'."
    #: the intro's scene (:data:`~.prompts.MAP_SCENE` or :data:`~.prompts.MAZE_SCENE`)
    scene_text: ClassVar[str] = MAP_SCENE
    system_prompt: ClassVar[str] = build_prompt(rules_text, default_variant, action_names(nle_actions),
                                                scene_text)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give a subclass the class-level :attr:`system_prompt` of its :attr:`default_variant`, built from
        its own class attributes by :meth:`build_system_prompt`, unless it sets one itself."""
        super().__init_subclass__(**kwargs)
        if "system_prompt" not in cls.__dict__:
            cls.system_prompt = cls.build_system_prompt(cls.default_variant, action_names(cls.nle_actions))

    def __init__(self, variant: str | None = None, view: str | None = None, max_steps: int | None = None,
                 inner_max_steps: int | None = None, render_mode: str | None = "ansi",
                 goal_offset: bool = False, query: str = "map", raw_key: str = "released") -> None:
        super().__init__(max_steps=self.default_max_steps if max_steps is None else max_steps,
                         render_mode=render_mode)
        if query not in ("map", "raw"):
            raise ValueError(f"{self.env_id}: query must be 'map' or 'raw', got {query!r}")
        if raw_key not in ("released", "reset"):
            raise ValueError(f"{self.env_id}: raw_key must be 'released' or 'reset', got {raw_key!r}")
        self.query = query
        self.has_entry_key = query == "raw" and raw_key == "released"
        # query="raw": the dictionary now, and the crops (computed anew by MiniHack on each step, where
        # the other arrays are NLE's reused buffers) at reset and after an episode's first action
        self._raw_obs: dict[str, np.ndarray] = {}
        self._raw_crops: dict[int, dict[str, np.ndarray]] = {}
        self.variant = variant or self.default_variant
        self.view = view or self.default_view
        self.goal_offset = bool(goal_offset)
        if self.view not in ("full", "crop"):
            raise ValueError(f"{self.env_id}: view must be 'full' or 'crop', got {self.view!r}")
        if self.variant not in gym.registry:
            raise ValueError(f"{self.env_id}: unknown MiniHack id {self.variant!r}")
        self.inner_max_steps = int(inner_max_steps or max(1000, 10 * self.max_steps))
        spec = gym.spec(self.variant)
        # The NLE step limit must reach the constructor: gym.make's own max_episode_steps only
        # wraps a TimeLimit (-1: none).
        spec = dataclasses.replace(spec, kwargs={**spec.kwargs,
                                                 "max_episode_steps": self.inner_max_steps})
        keys = ("chars", "glyphs", "blstats", "message", "screen_descriptions", *self.extra_obs_keys)
        if query == "raw":
            keys += tuple(k for k in self.raw_keys if k not in keys)
        self._env = gym.make(spec, max_episode_steps=-1, disable_env_checker=True,
                             observation_keys=keys, actions=self.nle_actions + self.hidden_actions)
        self._nle = self._env.unwrapped
        names = []
        self._key_index: dict[int, int] = {}  # key code -> its first index in the NLE action set
        for i, a in enumerate(self._nle.actions):
            self._key_index.setdefault(int(a), i)
        for a in self._nle.actions[:len(self.nle_actions)]:
            if int(a) not in ACTION_NAMES:
                raise ValueError(f"{self.env_id}: NLE action {a!r} of {self.variant} has no name")
            names.append(ACTION_NAMES[int(a)])
        self._action_names: list[str] = names
        self._action_index = {n: i for i, n in enumerate(names)}
        self._valid_line = f"Valid actions: {', '.join(names)}"
        self._parser = AnswerParser(names, {k: v for k, v in self.action_aliases.items()
                                            if v in self._action_index})
        self.system_prompt = self.build_system_prompt(self.variant, names)
        self._renderer = MapRenderer(self.view, self.goal_offset)
        self._end_status = 0
        self._reset_message = ""
        self._closed = False

    # ---- prompts --------------------------------------------------------------------------------
    @classmethod
    def build_system_prompt(cls, variant: str, actions: Sequence[str]) -> str:
        """The system prompt for ``variant`` with action names ``actions``: this class's
        :attr:`rules_text` and :attr:`scene_text` through :func:`~.prompts.build_prompt`."""
        return build_prompt(cls.rules_text, variant, actions, cls.scene_text)

    def task_prompt(self) -> str:
        """One line with the goal, e.g. ``"Reach the stairs down '>'."``."""
        return self.goal_text

    def retrieval_query(self, first_observation: str) -> str:
        """``"Observation: <observation>"``, the released MiniHack query's form (the goal is the same for
        every task of an env, so only the map tells tasks apart). With ``query="map"`` the observation
        is ``first_observation`` as rendered here; with ``query="raw"`` it is the text of NLE's
        observation dictionary at this moment (released: ``f"Observation: {raw_obs}"``)."""
        if self.query == "raw":
            return f"Observation: {self._raw_obs}"
        return f"Observation: {first_observation.strip()}"

    def entry_key(self, first_turn_acted: bool) -> str | None:
        """With ``query="raw"`` and ``raw_key="released"``, the text the entries distilled from the
        finished episode are keyed by, as the released code builds it; ``None`` otherwise (the key is
        the episode's retrieval query).

        Released: the key is ``build_memory_query(history[0])`` at episode end
        (``hook_on_episode_end``, ``memory_integration_mixin.py`` ~295-301), where ``history[0]
        ["raw_obs"]`` is the reset dictionary, replaced by the first step's when the episode's first
        reply was an action of the env (``traj_env_manager.py`` ``step`` ~292-295 merges the step's
        ``info`` into the entry of the turn just played; a reply that did not parse or a search-tool
        call has no ``raw_obs`` in its ``info``). Its NLE arrays are the env's reused buffers, so the
        text shows them as they are at episode end; only the crops, which MiniHack computes anew on
        each step, are those of the dictionary's own moment.

        Args:
            first_turn_acted: the episode's first reply went to the env (not a search-tool call).
        """
        if not self.has_entry_key:
            return None
        crops = self._raw_crops.get(1 if first_turn_acted and 1 in self._raw_crops else 0, {})
        return f"Observation: {({k: crops.get(k, v) for k, v in self._raw_obs.items()})}"

    def admissible_actions(self) -> list[str]:
        """The env's action names (fixed per env; the order of the NLE action set)."""
        return list(self._action_names)

    def parser(self) -> AnswerParser:
        """Cached :class:`AnswerParser` over :meth:`admissible_actions` and the aliases."""
        return self._parser

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        """The task's NetHack seeds (:func:`task_seeds`) and the rendered first observation they give
        with this env's settings and NLE build (:meth:`TextEnv.task_fingerprint`). Resets the env."""
        core, disp = task_seeds(self.check_task(task))
        return {"seeds": [core, disp], **super().task_fingerprint(task)}

    # ---- TextEnv hooks --------------------------------------------------------------------------
    def check_episode_limit(self, limit: Any) -> int:
        """An episode's action limit (:meth:`TextEnv.check_episode_limit`) within NLE's own
        ``inner_max_steps``, which would otherwise end the game first (as ABORTED).

        Raises:
            ValueError: below 1 or above ``inner_max_steps`` (construct the env with a larger one).
        """
        n = super().check_episode_limit(limit)
        if n > self.inner_max_steps:
            raise ValueError(f"{self.env_id}: an episode's max_steps {n} is above NLE's step limit "
                             f"{self.inner_max_steps} (setting inner_max_steps)")
        return n

    def _reset_task(self, task: int) -> None:
        if self._closed:
            raise RuntimeError(f"{self.env_id}: reset() after close()")
        core, disp = task_seeds(task)
        self._nle.seed(core, disp, False)
        obs, _info = self._env.reset()
        self._end_status = 0
        self._renderer.reset()
        self._capture(obs)
        msg = decode_text(obs["message"])
        self._reset_message = "" if _WELCOME in msg else msg

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        pre = self._before_step(action)
        obs, _r, term, trunc, info = self._send(action)
        self._end_status = int(info.get("end_status", 0))
        self._capture(obs)
        message = self._after_step(action, pre, decode_text(obs["message"]))
        if self._end_status == 2:
            return 1.0, True, True, "You reached the stairs down '>'. Success!"
        if self._end_status == 1:
            return 0.0, True, False, join_messages(message, "You died. Game over.")
        if self._end_status == -1:
            return 0.0, True, False, join_messages(message, "The game's own step limit was reached. "
                                                            "Game over.")
        if term or trunc:  # not expected: NLE reports every end through end_status
            return 0.0, True, False, join_messages(message, "Game over.")
        return 0.0, False, False, message

    def _observe(self, message: str = "") -> str:
        if self._steps == 0 and not message:
            message = self._reset_message
        lines = [self._renderer.frame]
        lines += self._status_lines()
        if message:
            lines.append(f"Last: {message}")
        lines.append(self._valid_line)
        return "\n".join(lines)

    def extra_info(self) -> dict[str, Any]:
        """``end_status`` (NLE's end of episode status) and ``agent_xy`` (the agent's map position)."""
        return {"end_status": self._end_status, "agent_xy": self._renderer.agent_xy}

    # ---- per-env hooks --------------------------------------------------------------------------
    def _capture(self, obs: dict[str, np.ndarray]) -> bool:
        """Render ``obs`` (NLE's live buffers) right away; ``False`` when the frame is blank (the game
        is over; the previous frame is kept). Subclasses read more of ``obs`` here. With
        ``query="raw"`` a copy of the dictionary of :attr:`raw_keys` is kept for
        :meth:`retrieval_query`, and its crops at reset and after the episode's first action for
        :meth:`entry_key`."""
        if self.query == "raw":
            self._raw_obs = {k: np.array(obs[k], copy=True) for k in self.raw_keys}
            if self._steps <= 1:            # reset (0), or the first step when it was a valid action (1)
                if self._steps == 0:
                    self._raw_crops.clear()
                self._raw_crops[self._steps] = {k: v for k, v in self._raw_obs.items() if k.endswith("_crop")}
        return self._renderer.capture(obs)

    def _before_step(self, action: str) -> Any:
        """Called before NLE steps with ``action``; its result is passed to :meth:`_after_step`."""
        return None

    def _after_step(self, action: str, pre: Any, message: str) -> str:
        """The step's message (NLE's ``message``, decoded) as the observation shows it."""
        return message

    def _send(self, action: str) -> tuple[Any, ...]:
        """Step MiniHack with the actor's ``action`` (a name of :meth:`admissible_actions`); returns the
        gymnasium step tuple. Subclasses that play a key sequence for one action override this."""
        return self._env.step(self._action_index[action])

    def _send_key(self, key: str | int) -> tuple[Any, ...]:
        """Step MiniHack with the key ``key`` (a character or key code), which must be the code of an
        action of :attr:`nle_actions` or :attr:`hidden_actions`; returns the gymnasium step tuple.

        Raises:
            KeyError: no action of the env's NLE action set has that key code.
        """
        code = ord(key) if isinstance(key, str) else int(key)
        return self._env.step(self._key_index[code])

    def _status_lines(self) -> list[str]:
        """Lines shown between the map and the message (e.g. KeyRoom's ``Key: carried.``)."""
        return []

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the wrapped NLE env (idempotent); the instance cannot be reset afterwards."""
        if not self._closed:
            self._closed = True
            self._env.close()
        super().close()
