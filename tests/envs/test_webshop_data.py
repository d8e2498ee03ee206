"""WebShop catalogue, goals and reward against upstream's behaviour (princeton-nlp/WebShop
``engine/engine.py``, ``engine/goal.py``, ``engine/normalize.py``) on the local 1k data (../shared/data)."""

from __future__ import annotations

import json
import random
from collections import Counter
from decimal import InvalidOperation

import pytest

from crl_bench.data import DataMissingError
from crl_bench.envs.webshop.goals import PRICE_RANGE, Goal, build_goals, draw_price_upper, sample_goal
from crl_bench.envs.webshop.products import Product, load_catalogue, parse_options, parse_pricing, webshop_dir
from crl_bench.envs.webshop.reward import (
    SpacyTagger,
    TableTagger,
    TaggerMissingError,
    fuzzy_match,
    get_option_reward,
    get_reward,
    get_type_reward,
    normalize_color,
)


@pytest.fixture(scope="module")
def cat():
    return load_catalogue()


@pytest.fixture(scope="module")
def goals(cat):
    return build_goals(cat)


# ---- catalogue ---------------------------------------------------------------------------------

def test_catalogue_counts(cat):
    assert len(cat.products) == 1000 and len(cat.by_asin) == 1000
    assert sum(1 for p in cat.products if p.options) == 423
    assert sum(len(p.options) for p in cat.products) == 614
    assert sum(p.instruction_text is not None for p in cat.products) == 415
    assert all(p.human_instructions is None for p in cat.products)
    assert cat.products[0].asin == "B06Y3VLDFB" and cat.products[-1].asin == "B00BT1QVW0"  # file order
    assert all(p.query == p.query.lower().strip() and p.title == p.name for p in cat.products)
    bullets = cat.by_asin["B09SWLPPVQ"].bullet_points               # a bare string in the file
    assert len(bullets) == 1 and bullets[0].startswith("[1200Mbps HIGH-SPEED")
    assert cat.by_asin["B09M4C31FL"].options == {"size": ["0.53oz | 15g x 10", "1.41oz | 40g x 10"]}
    assert cat.by_asin["B09DG92LJL"].options == {}      # its only option group is null
    assert cat.attribute_to_asins and all(a in cat.by_asin[x].attributes
                                          for a, asins in cat.attribute_to_asins.items() for x in asins)


def test_num_products_slices(cat):
    small = load_catalogue(num_products=100)
    assert [p.asin for p in small.products] == [p.asin for p in cat.products[:100]]


def test_missing_data_names_file(tmp_path):
    with pytest.raises(DataMissingError, match="items_shuffle_1000.json"):
        load_catalogue(tmp_path)


def test_parse_pricing_and_options():
    assert parse_pricing("$877.8") == ([877.8], "$877.8")
    assert parse_pricing("$19.99$27.99") == ([19.99, 27.99], "$19.99 to $27.99")
    assert parse_pricing("$1,299.00") == ([1299.0], "$1299.0")
    assert parse_pricing("$1$2$3") == ([1.0, 2.0], "$1.0 to $2.0")
    assert parse_pricing("") == ([100.0], "$100.0") == parse_pricing(None)
    with pytest.raises(IndexError):
        parse_pricing("12.5")
    with pytest.raises(InvalidOperation):
        parse_pricing("$abc")
    raw = {"Color ": [{"value": " Black/White "}, {"value": "Red"}, {"value": "Red"}], "Size": None}
    assert parse_options(raw) == {"color ": ["black | white", "red", "red"]}
    assert parse_options("") == {}


def test_prices_seeded(cat):
    again, other = load_catalogue(price_seed=0), load_catalogue(price_seed=1)
    assert again.prices == cat.prices
    ranged = [p for p in cat.products if len(p.pricing) == 2]
    assert len(ranged) == 93
    for p in cat.products:
        if len(p.pricing) == 1:
            assert cat.prices[p.asin] == other.prices[p.asin] == p.pricing[0]
        else:
            assert min(p.pricing) <= cat.prices[p.asin] <= max(p.pricing)   # some ranges run high to low
            assert p.price_text == f"${p.pricing[0]} to ${p.pricing[1]}"
    assert sum(cat.prices[p.asin] != other.prices[p.asin] for p in ranged) == 93
    assert cat.prices[ranged[0].asin] == random.Random(0).uniform(*ranged[0].pricing)  # first ranged draws first


# ---- goals -------------------------------------------------------------------------------------

def test_goal_order_anchors(cat, goals):
    assert len(goals) == 6910
    g0 = goals[0]
    assert (g0.asin, g0.goal_options, g0.weight) == ("B0743JKHBV", {"size": '28" x 28"'}, 0.05299377134820173)
    assert goals[1].asin == "B09QCP4579" and goals[1].goal_options == {"color": "black", "size": "3x-large"}
    assert (goals[3].asin, goals[3].goal_options, goals[3].weight) == ("B09LSKQF8C", {}, 0.75)
    assert goals[499].asin == "B01HQTWL6S" and goals[500].asin == "B094Q7B3SS"
    assert goals[6909].asin == "B09NPML43M"
    assert g0.instruction_text.startswith("Find me double sided, machine washable decorative pillows with "
                                          "printing technology with size: 28\" x 28\", and price lower than ")
    again = build_goals(cat)
    assert again == goals
    reseeded = build_goals(cat, seed=1)
    assert [(g.asin, g.goal_options, g.weight) for g in reseeded] == [(g.asin, g.goal_options, g.weight) for g in goals]
    assert any(a.price_upper != b.price_upper for a, b in zip(goals, reseeded))


def test_shuffle_matches_global_random():
    a, b = list(range(6910)), list(range(6910))
    random.seed(233)
    random.shuffle(a)
    random.Random(233).shuffle(b)
    assert a == b


def test_goal_contents_and_price_limits(cat, goals):
    per_asin = Counter(g.asin for g in goals)
    for p in cat.products:
        n = 1
        for values in p.options.values():
            n *= len(values)
        assert per_asin.get(p.asin, 0) == (n if p.instruction_text is not None else 0)
    uppers: dict[str, set] = {}
    for g in goals:
        p = cat.by_asin[g.asin]
        assert list(g.goal_options) == sorted(p.options) and g.attributes == p.instruction_attributes
        assert (g.query, g.name, g.category) == (p.query, p.title, p.category)
        cands = [x for x in PRICE_RANGE if x > cat.prices[g.asin]][:4]
        if len(cands) >= 2:
            assert g.price_upper in cands[1:]
            assert g.instruction_text.endswith(f", and price lower than {g.price_upper:.2f} dollars")
        else:
            assert g.price_upper == 1000000.0 and "price lower" not in g.instruction_text
        uppers.setdefault(g.asin, set()).add(g.price_upper)
    assert all(len(u) == 1 for u in uppers.values())            # one draw per product
    assert any(g.price_upper == 1000000.0 for g in goals)


def test_price_upper_distribution():
    rng = random.Random(5)
    c = Counter(draw_price_upper(12.0, rng)[0] for _ in range(6000))
    assert set(c) == {30.0, 40.0, 50.0}                         # candidates 20, 30, 40, 50
    assert abs(c[30.0] / 6000 - 1 / 6) < 0.03 and abs(c[50.0] / 6000 - 1 / 2) < 0.03
    assert draw_price_upper(985.0, rng) == (1000000.0, "")
    assert draw_price_upper(975.0, rng) == (990.0, ", and price lower than 990.00 dollars")


def test_goal_weights(goals):
    counts = Counter(a for g in goals for a in g.attributes)
    for g in goals[:300]:
        assert g.weight == pytest.approx(sum(1 / counts[a] for a in g.attributes) / len(g.attributes), rel=1e-12)
    assert sum(g.weight * len(g.attributes) for g in goals) == pytest.approx(len(counts))


def test_human_goals(cat):
    hcat = load_catalogue(human_goals=True)
    assert all(p.instruction_text is None for p in hcat.products)
    human = build_goals(hcat, human_goals=True)
    assert len(human) == 13 and all(g.weight == 1.0 and isinstance(g.goal_options, list) for g in human)
    raw = json.loads((webshop_dir() / "items_human_ins.json").read_text())
    assert sorted(g.asin for g in human) == sorted(raw)
    for g in human:
        rec = raw[g.asin][0]
        limit = f", and price lower than {g.price_upper:.2f} dollars" if g.price_upper < 1000000 else ""
        assert g.instruction_text == rec["instruction"].strip(".") + limit    # 'hair types.' loses its '.'
        assert g.goal_options == rec["instruction_options"] and g.attributes == rec["instruction_attributes"]
        assert (g.query, g.name) == (hcat.by_asin[g.asin].query, hcat.by_asin[g.asin].name)
    with pytest.raises(ValueError, match="human_goals"):
        build_goals(cat, human_goals=True)


def test_sample_goal_weighted():
    rng = random.Random(0)
    assert {sample_goal([0, 1, 2], [1.0, 0.0, 0.0], rng) for _ in range(50)} == {0}   # upstream never picks 0
    assert {sample_goal([0, 1, 2], [0.0, 0.0, 1.0], rng) for _ in range(50)} == {2}
    c = Counter(sample_goal([2, 0], [1.0, 5.0, 3.0], rng) for _ in range(8000))     # weights by goal index
    assert set(c) == {0, 2} and abs(c[2] / 8000 - 3 / 4) < 0.03
    with pytest.raises(ValueError):
        sample_goal([], [1.0], rng)


# ---- reward ------------------------------------------------------------------------------------

GOAL_NAME = "Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White"
TAGS = TableTagger({GOAL_NAME: ["mens", "d.o.n.", "issue", "gca", "basketball", "sneakers", "shoes", "white"],
                    "Power Cord A": ["power", "cord", "bar", "bar", "channel", "hd", "soundbar", "jbl", "ul", "prong"],
                    "Power Cord B": ["power", "cord", "outlet", "socket", "cable", "plug", "lead"],
                    "Nothing": [], "Other": ["lamp"], "One of twelve": ["a", "b", "c", "d", "e", "f", "g", "h", "i",
                                                                        "j", "k", "lamp"]})


def product(**kw) -> Product:
    base = dict(asin="B000000001", title="", description="", bullet_points=[], options={}, price_text="$35.0",
                pricing=[35.0], attributes=["tea tree", "essential oil", "natural ingredients"], category="beauty",
                query="query 1", product_category="a › b › c", name=GOAL_NAME)
    base.update(kw)
    return Product(**base)


def goal(**kw) -> Goal:
    base = dict(asin="B000000001", category="beauty", query="query 1", name=GOAL_NAME, product_category="a › b › c",
                instruction_text="", attributes=["tea tree", "essential oils", "natural ingredients"],
                price_upper=40.0, goal_options={"color": "grey", "size": "XL"})
    base.update(kw)
    return Goal(**base)


BOUGHT = {"color": "grey", "size": "XL"}


def test_reward_upstream_anchors():
    assert get_reward(product(), goal(), 35, BOUGHT, TAGS) == 1.0
    # bullet points given as a bare string upstream: ' '.join spaces out its characters
    p = product(attributes=[], bullet_points=list("This shampoo has essential oils and smells like lemons"),
                description="Best shampoo on the market, made with natural ingredients")
    assert get_reward(p, goal(), 35, BOUGHT, TAGS) == pytest.approx(4 / 6)
    g3 = goal(goal_options={"color": "grey", "size": "XL", "amount": "pack of 12"})
    assert get_reward(p, g3, 35, BOUGHT, TAGS) == pytest.approx(4 / 7)
    p_other = product(attributes=[], bullet_points=p.bullet_points, description=p.description, name="Power Cord B",
                      query="query 2", product_category="a › d › e")
    r, info = get_reward(p_other, goal(goal_options=g3.goal_options, name="Power Cord A"), 35, BOUGHT, TAGS,
                         verbose=True)
    assert r == pytest.approx(2 / 7) and info["r_type"] == 0.5 and info["title_score"] == pytest.approx(0.2)


def test_reward_price_and_option_terms():
    g = goal()                                         # D = 3 + 2 + 1
    assert get_reward(product(), g, 40.0, BOUGHT, TAGS) == 1.0
    assert get_reward(product(), g, 40.01, BOUGHT, TAGS) == pytest.approx(1 - 1 / 6)
    assert get_reward(product(), g, 35, {"color": "blue", "size": "XL"}, TAGS) == pytest.approx(1 - 1 / 6)
    assert get_reward(product(), g, 35, {"size": "XL"}, TAGS) == pytest.approx(1 - 1 / 6)
    r, info = get_reward(product(), g, 99, {}, TAGS, verbose=True)
    assert r == pytest.approx(3 / 6)
    assert info == dict(r_type=1.0, r_att=1.0, w_att=0.5, query_match=True, category_match=True, title_score=1.0,
                        r_option=0.0, w_option=2 / 6, r_price=False, w_price=1 / 6)
    _, info = get_reward(product(), goal(goal_options={}), 1, {}, TAGS, verbose=True)
    assert "r_option" not in info and info["w_price"] == 1 / 4


def test_reward_type_factor():
    def r_type(p_name, g_name, **kw):
        return get_type_reward(product(name=p_name, **kw), goal(name=g_name), TAGS)["r_type"]
    other = dict(query="q2", product_category="x › y")
    assert r_type("Other", GOAL_NAME) == 0.0                       # title_score 0 overrides query/category matches
    assert get_reward(product(name="Other"), goal(), 35, BOUGHT, TAGS) == 0.0
    assert r_type("Other", "One of twelve") == 0.1                # 1/12 < 0.1
    assert r_type("Power Cord B", "Power Cord A", **other) == 0.5  # 0.2 is not > 0.2, no query/category match
    assert r_type("Power Cord B", "Power Cord A") == 1.0           # same query
    assert r_type("Power Cord B", "Power Cord A", query="q2", product_category="a › b › z") == 1.0  # 2 parts shared
    assert r_type("Power Cord B", "Power Cord A", query="q2", product_category="a › z") == 0.5
    assert r_type("Other", "Nothing", **other) == 0.5             # goal name without nouns: title_score 0.2
    assert r_type("Nothing", GOAL_NAME) == 0.0
    assert get_reward(product(name="Power Cord B", **other), goal(name="Power Cord A"), 35, BOUGHT, TAGS) == 0.5


def test_attribute_term():
    g = goal(attributes=["tea tree", "Natural"])
    p = product(attributes=["tea  trees!"], title="All Natural shampoo", description="natural")
    _, info = get_reward(p, g, 35, BOUGHT, TAGS, verbose=True)
    assert info["r_att"] == 0.5                                 # fuzzy match; 'Natural' (not lowered) not found
    p2 = product(attributes=[], bullet_points=["Smells of TEA", "TREE oil"])
    assert get_reward(p2, goal(attributes=["tea tree"]), 35, BOUGHT, TAGS, verbose=True)[1]["r_att"] == 1.0


def test_option_tuple_quirk_and_colors():
    g = goal(goal_options={"size": "x-large"})
    assert get_reward(product(), g, 35, {"size": "large"}, TAGS, verbose=True)[1]["r_option"] == 1.0
    assert get_option_reward(["size"], {"size": "x-large"}.items()) == (1.0, 1)    # the name is a token
    assert get_option_reward(["size"], ["x-large"]) == (0.0, 0)                    # human goals: plain strings
    # synthetic goal 'large' vs bought 'x-large': "('size', 'large')" scores 83, the plain strings 100
    assert get_reward(product(), goal(goal_options={"size": "large"}), 35, {"size": "x-large"}, TAGS) < 1.0
    assert get_option_reward(["x-large"], ["large"]) == (1.0, 1)
    assert get_option_reward(["medium"], {"size": "x-large"}.items()) == (0.0, 0)
    assert normalize_color("standard") == "tan" and normalize_color("washed") == "ash"
    assert normalize_color("light blue") == "blue" and normalize_color("colored") == "red"
    assert normalize_color("xl") == "xl" and normalize_color(("color", "black")) == "black"
    assert normalize_color(("size", "light blue")) == ("size", "light blue")
    assert get_option_reward(["standard"], ["tan"]) == (1.0, 1)
    assert get_option_reward(["navy blue", "xl"], {"color": "dark navy", "size": "XL"}.items()) == (0.5, 1)


def test_fuzz_semantics_of_pinned_thefuzz():
    assert fuzzy_match("pack of 12", "pack of 1")               # 95
    assert not fuzzy_match("!!", "!!")                          # empty after processing -> 0
    assert not fuzzy_match("black", "black_style_99497")        # thefuzz 0.19: '_' is a word char (0.22: 100)


def test_real_goal_exact_purchase(cat, goals):
    tags = TableTagger({p.name: ["item"] for p in cat.products})
    g = goals[0]
    assert get_reward(cat.by_asin[g.asin], g, cat.prices[g.asin], dict(g.goal_options), tags) == 1.0
    wrong = {"size": next(v for v in cat.by_asin[g.asin].options["size"] if v != '28" x 28"')}
    assert get_reward(cat.by_asin[g.asin], g, cat.prices[g.asin], wrong, tags) < 1.0


def test_taggers():
    with pytest.raises(KeyError, match="no precomputed tags"):
        TAGS.nouns("unknown title")
    with pytest.raises(TaggerMissingError, match="crl_bench_no_such_model is installed"):
        SpacyTagger("crl_bench_no_such_model").nouns("Power Cord")


def test_table_tagger_from_json(tmp_path):
    path = tmp_path / "tags.json"
    path.write_text(json.dumps({"Power Cord": ["power", "cord"]}))
    assert TableTagger.from_json(path).nouns("Power Cord") == ["power", "cord"]
