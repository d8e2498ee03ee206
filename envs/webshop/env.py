"""WebShop (1,000 products): the text environment of WebShop's small configuration, without Java.

A faithful re-implementation of the text mode of princeton-nlp/WebShop (``web_agent_site/``): product
loading and cleaning (:mod:`.products`), synthetic or human goals shuffled with upstream's seed
(:mod:`.goals`), the reward of ``engine/goal.py::get_reward`` (:mod:`.reward`), BM25 search over the
same document text upstream indexes (:mod:`.search`), and the pages of ``web_agent_site/app.py`` and
``templates/`` rendered as upstream's ``text_rich`` observation (clickables marked ``[button] ...
[button_]``, selected ones ``[clicked button] ... [clicked button_]``).

Pages (``envs/web_agent_text_env.py`` + ``app.py``): search -> results (top 50 hits, 10 per page,
``< Prev`` from page 2, ``Next >`` always shown as upstream does) -> item (option buttons, one value per
option name, a re-click replaces it; ``Description``/``Features``/``Reviews`` sub-pages; ``< Prev`` goes
back; ``Buy Now`` ends the episode) and ``Back to Search`` everywhere. Actions: ``search[query]`` on the
search page and ``click[button]`` for a button of the current page; anything else (including
``search[...]`` away from the search page, which upstream tolerates) is an invalid action fed back.
The reward is given at ``Buy Now``; success = reward 1.0.

Task ids are goal indices in upstream's shuffled goal list: eval = the held-out test goals
(``test_goals``), train = the rest, sampled by goal weight (:meth:`task_weights`).  By default the
held-out goals are the first ones of the list, as upstream's baseline (``baseline_models/env.py``,
``WebEnv``: test = goals ``0..499``, eval = ``500..1499``, train = the rest, with the full catalogue):
synthetic goals ``0..499``; human goals the first ``min(500, ceil(0.3 * n))`` of the ``n`` human goals
(:func:`default_test_goals`).  With the 1k catalogue there are only 13 human goals (upstream's baseline
then uses every goal in every split, with no held-out set), so the 30% share holds out 4 of them and
trains on 9; with the full catalogue's human goals (over 12,000; any count >= 1,667) the rule gives
upstream's test goals ``0..499``.

Differences from upstream, all deliberate: ranged prices and ``price_upper`` are drawn from a seeded
RNG (upstream's global RNG is unseeded there, so its prices change run to run); goal sampling is
weighted without upstream's off-by-one (see :func:`.goals.sample_goal`); ``search[...]`` only on the
search page (the issue's rule); the search engine is ``bm25s`` with a Lucene-like analyzer by default
(``search_backend="pyserini"`` uses Lucene itself).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from crl_bench.data import data_dir as resolve_data_dir
from crl_bench.env_api import AnswerParser, ParsedAction, TextEnv, data_file_map

from .goals import Goal, build_goals
from .products import ATTRIBUTES_FILE, HUMAN_FILE, PRODUCTS_FILE, Catalogue, Product, load_catalogue, webshop_dir
from .reward import SpacyTagger, TableTagger, TitleTagger, get_reward
from .search import BM25Search, document_text

RESULTS_PER_PAGE = 10      # upstream PRODUCT_WINDOW
SEARCH_TOP_K = 50          # upstream SEARCH_RETURN_N
SUB_PAGES = ("description", "features", "reviews")

SYSTEM_PROMPT = (
    "You are shopping on a web store for the product described by the instruction. Each turn you see "
    "the current page; buttons are marked [button] NAME [button_]. Act with exactly one action: "
    "search[your query] on the search page, or click[NAME] to press a button of the current page "
    "(a product id, an option value, Description, Features, Reviews, < Prev, Next >, Back to Search, "
    "Buy Now). Select every option the instruction asks for before you click Buy Now. "
    "Reply as <answer>ACTION</answer>."
)

_ACTION_RE = re.compile(r"^\s*(search|click)\s*\[(.+)\]\s*$", re.IGNORECASE | re.DOTALL)


@dataclass
class WebShopWorld:
    """What every env instance of one configuration shares (built once per process).

    Attributes:
        catalogue: the products. goals: upstream's shuffled goal list. search: the search engine
        (``search(query, k) -> list[asin]``). tagger: POS tagger of the reward's product-type term.
    """

    catalogue: Catalogue
    goals: list[Goal]
    search: Any
    tagger: TitleTagger


@lru_cache(maxsize=4)
def _world(root: str, num_products: int, human_goals: bool, seed: int, search_backend: str,
           pyserini_index: str | None, tagger: str) -> WebShopWorld:
    cat = load_catalogue(Path(root), num_products=num_products, price_seed=seed,
                         human_goals=human_goals)
    goals = build_goals(cat, human_goals=human_goals, seed=seed)
    docs = [(p.asin, document_text(p.title, p.description, p.bullet_points, p.options))
            for p in cat.products]
    if search_backend == "bm25":
        engine = BM25Search(docs)
    elif search_backend == "pyserini":
        from .search import PyseriniSearch, build_pyserini_index

        index = Path(pyserini_index) if pyserini_index else Path(root) / "webshop" / "pyserini_index_1k"
        if not index.is_dir():
            build_pyserini_index(docs, index)
        engine = PyseriniSearch(index)
    else:
        raise ValueError(f"webshop: search_backend must be 'bm25' or 'pyserini', got {search_backend!r}")
    if tagger == "spacy":
        tag: TitleTagger = SpacyTagger("en_core_web_sm")
    else:
        tag = TableTagger.from_json(tagger)
    return WebShopWorld(cat, goals, engine, tag)


@dataclass
class _Session:
    """Upstream's session state (``SimServer`` session dict)."""

    page: str = "search"                 # search | results | item | sub | done
    keywords: str = ""
    page_num: int = 1
    results: list[str] = field(default_factory=list)
    asin: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    visited: set[str] = field(default_factory=set)
    sub_page: str = ""
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)


#: held-out share of the human goals when they are fewer than ``HELD_OUT_GOALS / HUMAN_TEST_SHARE``
HUMAN_TEST_SHARE = 0.3
#: held-out goals at most by default: upstream's baseline test goals ``0..499``
HELD_OUT_GOALS = 500


def default_test_goals(num_goals: int, human_goals: bool) -> range:
    """The default held-out (eval) goal indices for ``num_goals`` goals.

    Synthetic goals: ``range(0, 500)`` (upstream's baseline test goals).  Human goals: the first
    ``min(500, ceil(0.3 * num_goals))``, at least 1; with the 1k catalogue's 13 human goals that is
    ``range(0, 4)``.

    Raises:
        ValueError: too few goals to leave a non-empty train split (synthetic: <= 500; human: < 2).
    """
    if human_goals:
        held_out = min(HELD_OUT_GOALS, max(1, math.ceil(HUMAN_TEST_SHARE * num_goals)))
    else:
        held_out = HELD_OUT_GOALS
    if num_goals <= held_out:
        kind = "human" if human_goals else "synthetic"
        raise ValueError(f"webshop: {num_goals} {kind} goals leave no training goals after the "
                         f"default held-out goals 0..{held_out - 1}; set test_goals explicitly")
    return range(0, held_out)


def _parse_test_goals(spec: str | Sequence[int]) -> range:
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", spec)
        if not m:
            raise ValueError(f"webshop: test_goals must look like '0-499', got {spec!r}")
        return range(int(m.group(1)), int(m.group(2)) + 1)
    lo, hi = spec
    return range(int(lo), int(hi) + 1)


class WebShopEnv(TextEnv):
    """WebShop text env; see the module docstring.

    Args:
        max_steps: actions per episode before truncation (default 15).
        data_dir: data root (default ``$CRL_BENCH_DATA`` or the cache); files under ``webshop/``.
        num_products: products loaded (1000: the small configuration).
        human_goals: use the human instructions instead of the synthetic goals.
        test_goals: the held-out goal range (the eval split; the rest train), as ``"lo-hi"`` or
            ``(lo, hi)``, both ends included.  ``None`` (default): :func:`default_test_goals`, i.e.
            ``0..499`` for synthetic goals and the first 30% (at most 500) for human goals.
        seed: seeds the ranged prices and ``price_upper`` draws (the goal order uses upstream's 233).
        search_backend: ``"bm25"`` (bm25s, the default) or ``"pyserini"`` (Lucene; needs Java).
        pyserini_index: index folder for the pyserini backend (built there when missing).
        tagger: ``"spacy"`` (``en_core_web_sm``, the ``[webshop]`` extra) or a JSON file of precomputed
            ``{title: [nouns]}``.

    Raises:
        DataMissingError: the product files are not in the data dir.
        TaggerMissingError: the spaCy model is not installed (never a silently different reward).
        ValueError: ``test_goals`` is malformed, reaches outside the goal indices (the message names
            the valid range) or leaves no training goals.
    """

    env_id: ClassVar[str] = "webshop"
    system_prompt: ClassVar[str] = SYSTEM_PROMPT

    def __init__(self, max_steps: int = 15, data_dir: str | None = None, num_products: int = 1000,
                 human_goals: bool = False, test_goals: str | Sequence[int] | None = None, seed: int = 0,
                 search_backend: str = "bm25", pyserini_index: str | None = None, tagger: str = "spacy",
                 render_mode: str | None = "ansi") -> None:
        super().__init__(max_steps=max_steps, render_mode=render_mode)
        root = str(resolve_data_dir(data_dir))
        self.world = _world(root, int(num_products), bool(human_goals), int(seed), search_backend,
                            pyserini_index, tagger)
        self.data_root = Path(root)
        self.human_goals = bool(human_goals)
        n = len(self.world.goals)
        kind = "human" if human_goals else "synthetic"
        if test_goals is None:
            test = default_test_goals(n, bool(human_goals))
        else:
            test = _parse_test_goals(test_goals)
            if len(test) == 0:
                raise ValueError(f"webshop: test_goals {test_goals!r} is an empty range; give lo-hi "
                                 f"with lo <= hi within the {n} {kind} goals 0..{n - 1}")
            if test.start < 0 or test.stop > n:
                raise ValueError(f"webshop: test_goals {test_goals!r} outside the {n} {kind} goals "
                                 f"0..{n - 1} (human_goals={bool(human_goals)})")
            if len(test) >= n:
                raise ValueError(f"webshop: test_goals {test_goals!r} hold out all {n} {kind} goals "
                                 f"0..{n - 1}; leave some for training")
        self.splits = {"train": [i for i in range(n) if i not in test], "eval": list(test)}
        self._weights = {"train": [self.world.goals[i].weight for i in self.splits["train"]],
                         "eval": [self.world.goals[i].weight for i in self.splits["eval"]]}
        self.goal: Goal | None = None
        self.s = _Session()

    # ---- tasks ------------------------------------------------------------------------------------
    def task_weights(self, split: str) -> list[float]:
        """Sampling weight of each task of ``split`` (upstream's goal weights), aligned with
        :meth:`task_ids`."""
        self.task_ids(split)
        return self._weights[split]

    def task_prompt(self) -> str:
        return self.goal.instruction_text if self.goal is not None else ""

    def data_files(self) -> dict[str, Path]:
        """The JSON files this instance read (:meth:`TextEnv.data_files`): the products and the
        attributes file, plus the human-instruction file with ``human_goals`` (it is not read
        otherwise), e.g. ``{"webshop/items_shuffle_1000.json": Path(...), ...}``."""
        folder = webshop_dir(self.data_root)
        names = [PRODUCTS_FILE, ATTRIBUTES_FILE] + ([HUMAN_FILE] if self.human_goals else [])
        return data_file_map(self.data_root, [folder / n for n in names])

    def retrieval_query(self, first_observation: str) -> str:
        """``"Goal: <instruction>"``: the released WebShop query (the first page is the same search
        page for every task, so only the goal tells tasks apart)."""
        return f"Goal: {self.task_prompt()}"

    # ---- pages ------------------------------------------------------------------------------------
    def _product(self) -> Product:
        assert self.s.asin is not None
        return self.world.catalogue.by_asin[self.s.asin]

    def clickables(self) -> list[str]:
        """Lower-cased button names of the current page, in page order (upstream
        ``get_available_actions()['clickables']`` without ``search``)."""
        s = self.s
        if s.page == "search" or s.page == "done":
            return []
        if s.page == "results":
            out = ["back to search"] + (["< prev"] if s.page_num > 1 else []) + ["next >"]
            return out + [a.lower() for a in self._page_results()]
        if s.page == "item":
            p = self._product()
            opts = [v for values in p.options.values() for v in values]
            return ["back to search", "< prev", *SUB_PAGES, "buy now", *dict.fromkeys(opts)]
        return ["back to search", "< prev"]

    def _page_results(self) -> list[str]:
        start = (self.s.page_num - 1) * RESULTS_PER_PAGE
        return self.s.results[start:start + RESULTS_PER_PAGE]

    def admissible_actions(self) -> list[str] | None:
        """``click[...]`` of every button of the page; ``None`` (open) on the search page."""
        if self.s.page == "search":
            return None
        return [f"click[{c}]" for c in self.clickables()]

    def parse_action(self, reply: str) -> ParsedAction:
        text = AnswerParser(None).extract(reply if isinstance(reply, str) else str(reply))
        if text is None:
            return ParsedAction(None, str(reply).strip()[:200],
                                "No <answer>...</answer> found. Reply with <answer>ACTION</answer>.")
        m = _ACTION_RE.match(text)
        if not m:
            return ParsedAction(None, text, f"'{text[:60]}' is not an action: use search[query] or "
                                            f"click[button].")
        kind, arg = m.group(1).lower(), " ".join(m.group(2).split()).lower()
        if kind == "search":
            if self.s.page != "search":
                return ParsedAction(None, text, "There is no search bar on this page; "
                                                "click[Back to Search] first.")
            return ParsedAction(f"search[{arg}]", text)
        if arg not in self.clickables():
            return ParsedAction(None, text, f"There is no '{arg[:60]}' button on this page.")
        return ParsedAction(f"click[{arg}]", text)

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        """The goal of task id ``task`` (instruction, target product, attributes, options, price limit)
        and the target's price in this catalogue, the two things upstream's unseeded workers let vary
        (:meth:`TextEnv.task_fingerprint`; no reset). Raises ``KeyError`` for an unknown id."""
        g = self.world.goals[self.check_task(task)]
        return {"instruction": g.instruction_text, "asin": g.asin, "attributes": list(g.attributes),
                "goal_options": g.goal_options, "price_upper": g.price_upper,
                "target_price": self.world.catalogue.prices[g.asin]}

    # ---- TextEnv hooks ----------------------------------------------------------------------------
    def _reset_task(self, task: int) -> None:
        if not 0 <= task < len(self.world.goals):
            raise KeyError(f"webshop: unknown task id {task}; goals are 0..{len(self.world.goals) - 1}")
        self.goal = self.world.goals[task]
        self.s = _Session()

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        kind, arg = action.split("[", 1)
        arg = arg[:-1]
        s = self.s
        if kind == "search":
            s.keywords, s.page_num, s.page, s.asin, s.options = arg, 1, "results", None, {}
            s.results = self.world.search.search(arg, SEARCH_TOP_K)
            return 0.0, False, False, ""
        if arg == "back to search":
            self.s = _Session(visited=s.visited)
        elif arg == "next >":
            s.page_num += 1
            s.options = {}
        elif arg == "< prev":
            if s.page == "results":
                s.page_num -= 1
                s.options = {}
            elif s.page == "sub":
                s.page = "item"
            else:                                  # item -> results (upstream clears the options)
                s.page, s.asin, s.options = "results", None, {}
        elif arg in SUB_PAGES:
            s.page, s.sub_page = "sub", arg
        elif arg == "buy now":
            p = self._product()
            price = self.world.catalogue.prices[p.asin]
            reward, info = get_reward(p, self.goal, price, dict(s.options), self.world.tagger, verbose=True)
            s.page, s.reward, s.reward_info = "done", float(reward), info
            return float(reward), True, float(reward) == 1.0, ""
        elif s.page == "results":                  # a product link
            asin = next(a for a in self._page_results() if a.lower() == arg)
            s.page, s.asin = "item", asin
            s.visited.add(asin)
        else:                                       # an option value on the item page
            selected = ""
            for name, values in self._product().options.items():
                if arg in values:
                    selected = name                 # the last option group holding it (upstream)
            s.options[selected] = arg
        return 0.0, False, False, ""

    def _observe(self, message: str = "") -> str:
        s, g = self.s, self.goal
        instr = g.instruction_text if g is not None else ""
        lines: list[str] = []
        if message:
            lines.append(f"Last: {message}")

        def button(t: str) -> str:
            return f"[button] {t} [button_]"

        if s.page == "search":
            lines += ["WebShop", "Instruction: ", instr, button("Search")]
        elif s.page == "done":
            lines += ["Thank you for shopping with us!", f"Purchased: {s.asin}",
                      f"Your score (min 0.0, max 1.0): {s.reward}"]
        else:
            head = ["Instruction:", instr, button("Back to Search")]
            if s.page == "results":
                lines += head + [f"Page {s.page_num} (Total results: {len(s.results)})"]
                if s.page_num > 1:
                    lines.append(button("< Prev"))
                lines.append(button("Next >"))
                for asin in self._page_results():
                    p = self.world.catalogue.by_asin[asin]
                    mark = "[clicked button] {} [clicked button_]" if asin in s.visited else "[button] {} [button_]"
                    lines += ["", mark.format(asin), p.title, p.price_text]
            elif s.page == "item":
                p = self._product()
                clicked = [v for v in s.options.values()]
                lines = [f"You have clicked {v}." for v in reversed(clicked)] + lines + head + [button("< Prev")]
                for name, values in p.options.items():
                    lines.append(name)
                    for v in values:
                        chosen = s.options.get(name) == v
                        lines.append(f"  [clicked button] {v} [clicked button_]" if chosen else f"  {button(v)}")
                lines += [p.title, f"Price: {p.price_text}", "Rating: N.A.", button("Description"),
                          button("Features"), button("Reviews"), button("Buy Now")]
            else:
                p = self._product()
                lines += head + [button("< Prev")]
                if s.sub_page == "description" and p.description:
                    lines.append(p.description)
                elif s.sub_page == "features":
                    lines += [f" {b} " for b in p.bullet_points]
        return "\n".join(lines)

    def extra_info(self) -> dict[str, Any]:
        """``page`` (the page shown) and, after a purchase, ``reward_info`` (the reward's terms)."""
        info: dict[str, Any] = {"page": self.s.page}
        if self.s.page == "done":
            info["reward_info"] = self.s.reward_info
        return info
