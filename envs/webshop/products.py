"""WebShop product catalogue: loading and cleaning as upstream ``web_agent_site/engine/engine.py``
(``load_products``, ``clean_product_keys``, ``generate_product_prices``).

Files (in ``<data root>/webshop/``): ``items_shuffle_1000.json`` (products), ``items_ins_v2_1000.json``
(attributes and synthetic instructions), ``items_human_ins.json`` (human instructions).

Deliberate difference from upstream: a ranged price ("$a to $b") is drawn once with
``random.Random(price_seed).uniform(a, b)`` (in load order) instead of upstream's unseeded global RNG, so
prices, and the goals' price limits derived from them, are reproducible.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from crl_bench.data import DataMissingError, data_dir, read_data_json

PRODUCTS_FILE = "items_shuffle_1000.json"
ATTRIBUTES_FILE = "items_ins_v2_1000.json"
HUMAN_FILE = "items_human_ins.json"
DEFAULT_PRICE = 100.0


@dataclass
class Product:
    """One cleaned product (upstream's product dict after ``load_products``).

    Attributes:
        asin: as in the file (upper case, <= 10 chars). title / name: the raw ``name`` (upstream keeps both
            ``Title`` and ``name``). description: ``full_description``. bullet_points: ``small_description``
            (a bare string wrapped in a list).
        options: ``{option name lowercased (not stripped): [values stripped, lowercased, '/' -> ' | ']}``
            in file order, duplicates kept; option groups whose content is null are dropped.
        price_text: the displayed price, ``"$19.99"`` or ``"$19.99 to $27.99"`` (Python float repr).
        pricing: 1 or 2 floats (``[100.0]`` when the file has no price).
        attributes: from the attribute file (``["DUMMY_ATTR"]`` if the asin has none there).
        category, product_category ('›'-joined breadcrumb), query (lowercased, stripped).
        instruction_text, instruction_attributes: the synthetic instruction (only when loaded with
            ``human_goals=False``; None if the product has none).
        human_instructions: the human instruction records (only with ``human_goals=True`` and when the
            asin is in the human file).
    """

    asin: str
    title: str
    description: str
    bullet_points: list[str]
    options: dict[str, list[str]]
    price_text: str
    pricing: list[float]
    attributes: list[str]
    category: str
    query: str
    product_category: str
    instruction_text: str | None = None
    instruction_attributes: list[str] | None = None
    human_instructions: list[dict] | None = None
    name: str = ""


@dataclass
class Catalogue:
    """The loaded products (upstream's ``load_products`` return tuple).

    Attributes:
        products: in load order. by_asin: ``{asin: Product}``. prices: ``{asin: price in dollars}``, drawn
            once (see the module docstring). attribute_to_asins: ``{attribute: {asin, ...}}``.
        human_goals: which instruction fields were loaded (see :class:`Product`).
    """

    products: list[Product]
    by_asin: dict[str, Product]
    prices: dict[str, float]
    attribute_to_asins: dict[str, set[str]] = field(default_factory=dict)
    human_goals: bool = False


def parse_pricing(pricing: str | None) -> tuple[list[float], str]:
    """``(pricing floats, price text)`` of a raw ``pricing`` string such as ``'$19.99$27.99'``.

    Every '$'-separated piece loses its non-digit, non-'.' characters and becomes
    ``float(Decimal(piece))``; more than two pieces keep the first two. Empty or None -> ``([100.0], '$100.0')``.
    Follows ``engine.py::load_products``.

    Raises:
        IndexError: a non-empty string without '$' (as upstream). decimal.InvalidOperation: a piece with no number.
    """
    if not pricing:
        return [DEFAULT_PRICE], f"${DEFAULT_PRICE}"
    values = [float(Decimal(re.sub(r"[^\d.]", "", piece))) for piece in pricing.split("$")[1:]]
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def parse_options(raw) -> dict[str, list[str]]:
    """``customization_options`` (``''`` or ``{Name: [{'value': ...}, ...] | None}``) -> ``{name: [values]}``.

    Names are lowercased only; values are stripped, lowercased, and '/' becomes ' | '. Follows
    ``engine.py::load_products``.
    """
    options: dict[str, list[str]] = {}
    if raw:
        for name, contents in raw.items():
            if contents is not None:
                options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    return options


def draw_price(pricing: list[float], rng: random.Random) -> float:
    """The price a product sells at: 100.0 for no pricing, the single value, else ``rng.uniform(lo, hi)``.

    Follows ``engine.py::generate_product_prices`` (with a seeded ``rng`` instead of the global RNG).
    """
    if not pricing:
        return DEFAULT_PRICE
    if len(pricing) == 1:
        return pricing[0]
    return rng.uniform(pricing[0], pricing[1])


def webshop_dir(data_root: str | os.PathLike | None = None) -> Path:
    """The folder holding the WebShop files: ``data_dir(data_root) / "webshop"``; a ``data_root`` that
    itself holds ``items_shuffle_1000.json`` is used as it is."""
    if data_root is not None and (Path(data_root) / PRODUCTS_FILE).is_file():
        return Path(data_root)
    return data_dir(data_root) / "webshop"


def missing_data_error(folder: Path, name: str) -> DataMissingError:
    """The error for a WebShop file ``name`` absent from ``folder``: it names the download command and
    the three files."""
    return DataMissingError(
        f"WebShop data file {name} not found in {folder}. Run `crl-bench data download webshop` (fetches "
        f"{PRODUCTS_FILE}, {ATTRIBUTES_FILE} and {HUMAN_FILE} into the data dir and verifies them), or "
        f"point CRL_BENCH_DATA (or the env's data_dir) at a folder whose webshop/ holds those three files.")


def _read_json(folder: Path, name: str):
    """The parsed data file ``folder/name``; DataMissingError when absent, DataInvalidError (one line
    naming the file and the download command) when it is not JSON or nested too deeply."""
    path = folder / name
    if not path.is_file():
        raise missing_data_error(folder, name)
    return read_data_json(path, "crl-bench data download webshop")


def kept_products(raw: list[dict]) -> list[dict]:
    """The entries of a products list that the catalogue keeps, in file order: those whose asin is not
    ``'nan'``, at most 10 characters long and not seen before (``engine.py::load_products``).

    Raises:
        KeyError: an entry has no ``asin``. TypeError: an entry is not a dict.
    """
    seen: set[str] = set()
    out = []
    for p in raw:
        asin = p["asin"]
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        out.append(p)
    return out


def clean_product(p: dict) -> Product:
    """One products-file entry cleaned as ``engine.py::load_products`` does: the fields that come from
    the products file; ``attributes`` is left empty and the instruction fields unset (they come from
    the attribute and human files).

    Raises:
        KeyError: a field the catalogue needs is absent (``name``, ``full_description``,
            ``small_description``, ``customization_options``, ``category``, ``query``,
            ``product_category``). IndexError / decimal.InvalidOperation: see :func:`parse_pricing`.
    """
    pricing, price_text = parse_pricing(p.get("pricing"))
    bullets = p["small_description"]
    return Product(
        asin=p["asin"], title=p["name"], name=p["name"], description=p["full_description"],
        bullet_points=bullets if isinstance(bullets, list) else [bullets],
        options=parse_options(p["customization_options"]), price_text=price_text, pricing=pricing,
        attributes=[], category=p["category"], query=p["query"].lower().strip(),
        product_category=p["product_category"])


#: The :class:`Product` fields that come from the products file (what :func:`product_digest` covers).
PRODUCT_FILE_FIELDS = ("asin", "title", "name", "description", "bullet_points", "options", "price_text",
                       "pricing", "category", "query", "product_category")


def product_digest(prod: Product) -> str:
    """Hex sha256 of the products-file part of a cleaned product (:data:`PRODUCT_FILE_FIELDS`) as
    canonical JSON (sorted keys, no spaces, UTF-8, floats as Python's repr). Raw entries that the
    catalogue cleans to the same product have the same digest, whatever their raw bytes."""
    record = {k: getattr(prod, k) for k in PRODUCT_FILE_FIELDS}
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_catalogue(data_root: Path | None = None, num_products: int | None = 1000, price_seed: int = 0,
                   human_goals: bool = False) -> Catalogue:
    """Load and clean the first ``num_products`` products (upstream ``load_products`` + ``clean_product_keys``).

    The slice is taken before dropping products whose asin is ``'nan'`` or longer than 10 chars and later
    duplicates of an asin, so fewer may survive (None = all). With ``human_goals`` the human instruction
    records are attached, else the synthetic instruction fields (as upstream; goals are built from
    whichever was loaded). Prices are drawn with ``random.Random(price_seed)`` in load order.

    Raises:
        DataMissingError: a data file is absent (the human file is needed only with ``human_goals``), or
            (synthetic) a product's asin is absent from the attribute file (upstream: KeyError).
    """
    folder = webshop_dir(data_root)
    raw = _read_json(folder, PRODUCTS_FILE)
    attrs = _read_json(folder, ATTRIBUTES_FILE)
    human = _read_json(folder, HUMAN_FILE) if human_goals else {}
    if num_products is not None:
        raw = raw[:num_products]
    rng = random.Random(price_seed)
    products: list[Product] = []
    by_asin: dict[str, Product] = {}
    for p in kept_products(raw):
        asin = p["asin"]
        prod = clean_product(p)
        entry = attrs.get(asin, {})
        prod.attributes = entry["attributes"] if "attributes" in entry else ["DUMMY_ATTR"]
        if human_goals:
            prod.human_instructions = human.get(asin)
        elif asin not in attrs:
            raise DataMissingError(f"WebShop: product {asin} is missing from {folder / ATTRIBUTES_FILE}")
        else:
            prod.instruction_text = entry.get("instruction")
            prod.instruction_attributes = entry.get("instruction_attributes")
        products.append(prod)
        by_asin[asin] = prod
    attribute_to_asins: dict[str, set[str]] = {}
    for prod in products:
        for a in prod.attributes:
            attribute_to_asins.setdefault(a, set()).add(prod.asin)
    prices = {prod.asin: draw_price(prod.pricing, rng) for prod in products}
    return Catalogue(products, by_asin, prices, attribute_to_asins, human_goals)
