"""Tests of the WebShop product search (envs/webshop/search.py); none needs Java.

Expected tokens and rankings marked "Lucene" were observed with upstream's engine: pyserini 0.17.0
(Anserini 0.14.3) on Java 17, index built as ``search_engine/run_indexing.sh`` does from the
``contents`` of the 1,000 products in ``items_shuffle_1000.json``.
"""

from __future__ import annotations

import importlib.util
import json
import random

import numpy as np
import pytest

from crl_bench.data import data_dir
from crl_bench.envs.webshop import search as S


def _load_docs() -> list[tuple[str, str]]:
    """(asin, contents) of the 1,000-product file, built as upstream's load_products + converter."""
    path = data_dir() / "webshop" / "items_shuffle_1000.json"
    docs, seen = [], set()
    for p in json.loads(path.read_text()):
        asin = p["asin"]
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        bullets = p["small_description"]
        bullets = bullets if isinstance(bullets, list) else [bullets]
        options = {}
        for name, values in (p["customization_options"] or {}).items():
            if values is not None:
                options[name.lower()] = [
                    v["value"].strip().replace("/", " | ").lower() for v in values
                ]
        docs.append((asin, S.document_text(p["name"], p["full_description"], bullets, options)))
    return docs


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, str]]:
    return _load_docs()


@pytest.fixture(scope="module")
def engine(docs) -> S.BM25Search:
    return S.BM25Search(docs)


# ------------------------------------------------------------------------------------------
# document_text


def test_document_text_joins_fields_as_upstream():
    text = S.document_text(
        "Cool Shirt",
        "A Nice Shirt.",
        ["Soft Cotton", "never indexed"],
        {"color": ["black", "red | blue"], "size": ["x-large"]},
    )
    assert text == "cool shirt a nice shirt. soft cotton color: black, red | blue, and size: x-large"


def test_document_text_without_options_keeps_trailing_space():
    # ' '.join([..., option_text]) with an empty option_text leaves a trailing space upstream too
    assert S.document_text("T", "", ["B"], {}) == "t  b "


def test_document_text_rejects_empty_bullets():
    with pytest.raises(ValueError, match="BulletPoints"):
        S.document_text("T", "D", [], {})


def test_document_text_real_product(docs):
    contents = dict(docs)["B06Y3VLDFB"]
    assert contents.startswith("vhomes lights reclaimed wood console table the genessis collection")
    assert contents == contents.lower()
    assert len(docs) == 1000


# ------------------------------------------------------------------------------------------
# Tokenizer and analyzer (expected values observed from Lucene's StandardTokenizer/EnglishAnalyzer)


@pytest.mark.parametrize(
    "text, expected",
    [
        # hyphens split; decimals stay whole
        ("men's x-large 3.5 oz", ["men's", "x", "large", "3.5", "oz"]),
        ("3x-large 2.5-inch 1/2 10% $19.99 c++", ["3x", "large", "2.5", "inch", "1", "2", "10", "19.99", "c"]),
        # one mid character joins letters or digits; letter.digit breaks
        ("a.b.c U.S.A. 1,000.5 5'6 3;5 3:5 x.5 2x.5 1.5x",
         ["a.b.c", "U.S.A", "1,000.5", "5'6", "3;5", "3", "5", "x", "5", "2x", "5", "1.5x"]),
        ("don't rock'n'roll '90s a..b .5 5.", ["don't", "rock'n'roll", "90s", "a", "b", "5", "5"]),
        ("hello_world foo@bar.com size:large", ["hello_world", "foo", "bar.com", "size:large"]),
        # emoji and trade marks are tokens; superscripts/fractions are not word characters
        ("love\u2764\ufe0fit tm\u2122 x\u00b2 \u00bd", ["love", "\u2764\ufe0f", "it", "tm", "\u2122", "x"]),
        # ideographs one by one, katakana as a run, soft hyphen does not start a word
        ("\u65e5\u672c\u8a9e \u30c6\u30b9\u30c8 \u00ad\u00adold",
         ["\u65e5", "\u672c", "\u8a9e", "\u30c6\u30b9\u30c8", "old"]),
    ],
)
def test_tokenize_follows_standard_tokenizer(text, expected):
    assert S.tokenize(text) == expected


def test_tokenize_cuts_long_tokens():
    assert S.tokenize("x" * 300) == ["x" * 255, "x" * 45]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("men's x-large 3.5 oz", ["men", "x", "larg", "3.5", "oz"]),  # possessive, Porter
        ("it's the women's shoes", ["women", "shoe"]),  # it's -> it (stop word)
        ("MEN'S JAMES'S O\u2019Neil\u2019s", ["men", "jame", "o\u2019neil"]),  # 'S and \u2019s
        ("the and a an with no not such there these", []),  # stop words
        ("running runs easily generously relational ponies caresses",
         ["run", "run", "easili", "gener", "relat", "poni", "caress"]),
        # Porter's reference implementation (Lucene), not the published algorithm (Snowball):
        ("assembly technology possibly us xs 3s", ["assembl", "technolog", "possibl", "us", "xs", "3s"]),
        ("na\u00efve rock'n'roll '90s", ["na\u00efv", "rock'n'rol", "90"]),
    ],
)
def test_analyze_matches_lucene(text, expected):
    assert S.analyze(text) == expected


def test_stop_words_are_lucenes_33():
    assert len(S.ENGLISH_STOP_WORDS) == 33
    assert {"a", "with", "will", "such"} <= S.ENGLISH_STOP_WORDS
    assert not {"me", "i", "you", "than", "from"} & S.ENGLISH_STOP_WORDS


# ------------------------------------------------------------------------------------------
# Lucene length norms


@pytest.mark.parametrize(
    "length, decoded",
    [(0, 0), (23, 23), (24, 24), (39, 39), (40, 40), (41, 40), (61, 60), (107, 104), (300, 280)],
)
def test_length_norm_round_trip(length, decoded):
    code = S.lucene_encode_length(length)
    assert 0 <= code <= 255
    assert S.lucene_decode_length(code) == decoded


def test_length_norm_is_monotone_and_never_overstates():
    decoded = [S.lucene_decode_length(S.lucene_encode_length(n)) for n in range(5000)]
    assert all(a <= b for a, b in zip(decoded, decoded[1:]))
    assert all(d <= n for n, d in enumerate(decoded))
    with pytest.raises(ValueError):
        S.lucene_encode_length(-1)
    with pytest.raises(ValueError):
        S.lucene_decode_length(256)


# ------------------------------------------------------------------------------------------
# BM25Search on the real data


def test_title_query_finds_its_product(engine, docs):
    path = data_dir() / "webshop" / "items_shuffle_1000.json"
    products = json.loads(path.read_text())[:100]
    missed = [p["asin"] for p in products if engine.search(p["name"], k=1) != [p["asin"]]]
    assert missed == []


def test_lucene_score_of_one_term(engine):
    # Lucene explain: weight(contents:pink in B07F2G93BJ) = 1.4847934 (idf 2.5846221, dl 61 -> 60)
    hits = dict(engine.search_with_scores("pink", k=100))
    assert hits["B07F2G93BJ"] == pytest.approx(1.4847934, rel=1e-7)
    assert len(hits) == 75  # documents containing "pink"


LUCENE_TOP = {
    # an instruction text (goal), first 10 hits
    "Find me sulfate free, paraben free shampoo & conditioner with hyaluronic acid, coconut oil for "
    "damaged hair, hair growth, hair loss": [
        "B07B6DVG41", "B07CKTXS1J", "B08Q42DTN1", "B09SHRV5JW", "B07FLKB8CV",
        "B07B41K2VV", "B09PY89B1S", "B01BV3XRG8", "B082WKKPDH", "B09FYBZNQL",
    ],
    # equal scores (4-, 2- and 3-way ties) come in asin order
    "due": [
        "B07ZR54L56", "B08QVDNJC7", "B07ZWVS584", "B0816QM13S", "B097TTFZ43", "B09JT3Z6JV",
        "B00X2UAMXU", "B0861GWJV2", "B09T33VS4Y", "B08R3XSC65", "B09GLMTMHM", "B09PY89B1S",
    ],
    "date when": [
        "B074FMTQNC", "B015PWVRPO", "B09J4RS3V1", "B08LQZ5BRC", "B099231V35", "B09M63B87V",
        "B09PV9J15D", "B09QCVCYVY", "B09QQP3356", "B084HBQYTD", "B07MJGQ6NK", "B093HFSQ3B",
    ],
    # a repeated term
    "0.8 0.8": ["B085RRL27J", "B08M6D6TVK", "B09S2Z2GMJ", "B09D42HCTN"],
}  # fmt: skip


@pytest.mark.parametrize("query", list(LUCENE_TOP))
def test_rankings_match_lucene(engine, query):
    expected = LUCENE_TOP[query]
    assert engine.search(query, k=len(expected)) == expected


def test_top_k_size_and_prefix(engine):
    top50 = engine.search("women's shoes size 8", k=50)
    assert len(top50) == 50 and len(set(top50)) == 50
    assert engine.search("women's shoes size 8") == top50  # default k is upstream's 50
    assert engine.search("women's shoes size 8", k=7) == top50[:7]
    assert engine.search("women's shoes size 8", k=0) == []
    assert engine.search("zzzqqq", k=50) == []  # no term in the index: no hits
    assert engine.search("the and of", k=50) == []  # only stop words: no hits
    assert len(engine.search("0.8 0.8", k=50)) == 4  # fewer matching docs than k
    with pytest.raises(ValueError):
        engine.search("shoes", k=-1)


def test_search_is_deterministic_and_independent_of_doc_order(engine, docs):
    queries = ["long lasting hair spray", "usb c charger", "gluten free snacks", "red dress"]
    first = engine.search_batch(queries, k=50)
    assert engine.search_batch(queries, k=50) == first
    shuffled = list(docs)
    random.Random(0).shuffle(shuffled)
    assert S.BM25Search(shuffled).search_batch(queries, k=50) == first


def test_scores_are_sorted_and_positive(engine):
    hits = engine.search_with_scores("stainless steel water bottle", k=50)
    scores = [s for _, s in hits]
    assert scores == sorted(scores, reverse=True)
    assert all(s > 0 for s in scores)
    assert engine.scores("stainless steel water bottle").shape == (len(engine),)


# ------------------------------------------------------------------------------------------
# BM25Search on small corpora: ties and repeated query terms


def test_ties_are_broken_by_asin_not_index_order():
    text = "plain cotton shirt"
    docs = [("B3", text), ("B1", text), ("B2", text), ("A9", "something else")]
    engine = S.BM25Search(docs)
    assert engine.search("cotton", k=10) == ["B1", "B2", "B3"]


def test_repeated_query_terms_weigh_more():
    docs = [("B2", "red box case"), ("B1", "shoe box case"), ("B3", "other thing here")]
    engine = S.BM25Search(docs)
    # one occurrence each: the two documents tie and come in asin order
    assert engine.search("red shoe", k=10) == ["B1", "B2"]
    # a repeated term counts again (one SHOULD clause per token): "red" now wins
    assert engine.search("red red shoe", k=10) == ["B2", "B1"]
    one = engine.scores("red")[0]
    assert engine.scores("red red")[0] == pytest.approx(2 * one, rel=1e-7)


def test_bm25_search_rejects_bad_corpora():
    with pytest.raises(ValueError):
        S.BM25Search([])
    with pytest.raises(ValueError):
        S.BM25Search([("B1", "a"), ("B1", "b")])


def test_document_length_norm_changes_ranking():
    # 41 and 40 terms share a norm in Lucene, so these documents tie and come in asin order;
    # with exact lengths the shorter document would win.
    filler = " ".join(f"w{i}" for i in range(39))
    docs = [("B1", "target " + filler + " extra"), ("B2", "target " + filler)]
    engine = S.BM25Search(docs + [("B9", "unrelated")])
    scores = dict(engine.search_with_scores("target"))
    assert scores["B1"] == scores["B2"]
    assert engine.search("target") == ["B1", "B2"]


# ------------------------------------------------------------------------------------------
# agreement and the optional pyserini backend


class _Fixed:
    def __init__(self, results):
        self.results = results

    def search_batch(self, queries, k):
        return [r[:k] for r in self.results]


def test_agreement_metrics():
    a = _Fixed([["x", "y", "z"], ["p", "q"], []])
    b = _Fixed([["x", "z", "y"], ["q", "p"], []])
    r = S.agreement(a, b, ["q1", "q2", "q3"])
    assert r["n_queries"] == 3
    assert r["top1"] == pytest.approx(2 / 3)  # q1 and the empty q3
    assert r["exact_top10"] == pytest.approx(1 / 3)
    assert r["set_top10"] == pytest.approx(1.0)
    assert r["overlap_at_10"] == pytest.approx((3 / 10 + 2 / 10 + 0) / 3)
    assert r["jaccard_at_k"] == pytest.approx(1.0)
    # a precomputed reference works too; a wrong length is an error
    assert S.agreement(a, [["x"], ["p"], []], ["q1", "q2", "q3"])["top1"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        S.agreement(a, [["x"]], ["q1", "q2", "q3"])


@pytest.mark.skipif(importlib.util.find_spec("pyserini") is not None, reason="pyserini is installed")
def test_pyserini_backend_reports_what_is_missing(tmp_path):
    with pytest.raises(S.PyseriniUnavailableError, match="pyserini"):
        S.PyseriniSearch(tmp_path)
    with pytest.raises(S.PyseriniUnavailableError, match="pyserini"):
        S.build_pyserini_index([("B1", "text")], tmp_path / "index")
    with pytest.raises(FileNotFoundError):
        S.PyseriniSearch(tmp_path / "missing")


def test_agreement_with_itself_is_total(engine):
    queries = ["usb cable", "organic green tea", "the"]
    r = S.agreement(engine, engine, queries)
    assert r["top1"] == r["exact_top10"] == r["jaccard_at_k"] == r["exact_top_k"] == 1.0
    assert np.isclose(r["overlap_at_10"], 2 / 3)  # "the" has no hits: 0 overlap out of 10
