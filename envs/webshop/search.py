"""WebShop product search: BM25 over the product index, scored as upstream's Lucene index scores it.

Upstream (princeton-nlp/WebShop) builds one Lucene document per product with pyserini 0.17
(``search_engine/convert_product_file_format.py`` writes ``{"id": asin, "contents": ...}`` JSON lines,
``search_engine/run_indexing.sh`` indexes them) and answers every ``search[...]`` action with
``LuceneSearcher.search(' '.join(keywords), k=50)`` (``web_agent_site/engine/engine.py``,
``get_top_n_product_from_keywords``). This module re-implements that in our own code:

* :func:`document_text` -- the indexed ``contents`` string of one product.
* :func:`analyze` -- Lucene's ``EnglishAnalyzer`` chain as Anserini configures it for pyserini's
  default index (``DefaultEnglishAnalyzer``): StandardTokenizer -> EnglishPossessiveFilter ->
  LowerCaseFilter -> StopFilter (Lucene's 33 English stop words) -> PorterStemFilter.
* :class:`BM25Search` -- the default backend: BM25 with Lucene's formula and parameters
  (k1=0.9, b=0.4, Lucene's lossy one-byte document-length norms) through the ``bm25s`` library.
  It needs no Java.
* :class:`PyseriniSearch` / :func:`build_pyserini_index` -- an optional backend that runs real
  Lucene through ``pyserini`` (needs the package and a Java runtime).
* :func:`agreement` -- top-k agreement between two backends over a list of queries.

Measured with :func:`agreement` on the 1,000-product data (``items_shuffle_1000.json``) against
pyserini 0.17.0 (upstream's pin, Lucene 8) and 0.22.1 (Lucene 9), which return identical hits:
:class:`BM25Search` returns the same top-50 list, in the same order, for all 415 instruction
texts, all 6,910 synthetic goal texts (with and without the price clause) and 5,079 further
queries (titles, product queries, random 1-10-word slices of documents, repeated terms); its
analyzer yields Lucene's terms for every document and query there.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "ENGLISH_STOP_WORDS",
    "MAX_TOKEN_LENGTH",
    "K1",
    "B",
    "SEARCH_RETURN_N",
    "document_text",
    "tokenize",
    "analyze",
    "lucene_encode_length",
    "lucene_decode_length",
    "BM25Search",
    "PyseriniSearch",
    "PyseriniUnavailableError",
    "build_pyserini_index",
    "agreement",
]

#: Lucene's ``EnglishAnalyzer.ENGLISH_STOP_WORDS_SET`` (33 words), which Anserini's
#: ``DefaultEnglishAnalyzer`` uses unless told otherwise.
ENGLISH_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then "
    "there these they this to was will with".split()
)

#: ``StandardTokenizer``'s default maximum token length; longer runs are cut into pieces this long.
MAX_TOKEN_LENGTH = 255

#: BM25 parameters of Anserini's searcher defaults (``SearchCollection.Args``: ``bm25.k1``, ``bm25.b``),
#: which pyserini's ``LuceneSearcher`` uses when nothing is set (upstream sets nothing).
K1 = 0.9
B = 0.4

#: Hits asked for per search: ``SEARCH_RETURN_N`` in ``web_agent_site/engine/engine.py``.
SEARCH_RETURN_N = 50


# --------------------------------------------------------------------------------------------
# Indexed text


def document_text(
    title: str,
    description: str,
    bullet_points: Sequence[str],
    options: Mapping[str, Sequence[str]],
) -> str:
    """The ``contents`` field upstream indexes for one product.

    Follows ``search_engine/convert_product_file_format.py`` (the loop over ``load_products``):
    ``option_text = ', and '.join(f'{name}: {", ".join(values)}' for name, values in options.items())``
    and ``contents = ' '.join([Title, Description, BulletPoints[0], option_text]).lower()``.

    Args:
        title: the product's ``Title`` (raw ``name``).
        description: the product's ``Description`` (raw ``full_description``, may be ``''``).
        bullet_points: the product's ``BulletPoints`` list; only the first entry is indexed.
        options: option name -> values, as ``load_products`` builds them (names lowercased,
            values stripped, lowercased, ``'/'`` replaced by ``' | '``), in the product's order.

    Returns:
        The lowercased document text.

    Raises:
        ValueError: ``bullet_points`` is empty (upstream fails there with an ``IndexError``; no
            product of the released data has an empty list).
    """
    if len(bullet_points) == 0:
        raise ValueError("bullet_points is empty: upstream indexes BulletPoints[0]")
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in options.items())
    return " ".join([title, description, bullet_points[0], option_text]).lower()


# --------------------------------------------------------------------------------------------
# Tokenizer: a regular-expression approximation of Lucene's StandardTokenizer
#
# StandardTokenizer implements the word-break rules of Unicode UAX #29 and emits only the
# segments that hold a letter, digit, ideograph, kana, Hangul, South-East-Asian script or emoji.
# The expression below reproduces the rules that matter for (mostly English) product text; each
# was checked against Lucene 9's StandardTokenizer (pyserini 0.22.1):
#
#  1. A token is a run of letters, digits and connector punctuation ("_" and the other
#     Unicode ExtendNumLet characters): "abc123", "12x24", "hello_world", "a_" stay whole
#     (WB8-WB10, WB13a/b). A run of connectors alone ("__") is no token.
#  2. Everything else breaks: spaces, hyphens of every kind ("x-large" -> x, large;
#     "3x-large" -> 3x, large), slashes ("1/2" -> 1, 2), parentheses, brackets, quotes, "&",
#     "+", "%", "$", "#", "@" ("c++" -> c, "$19.99" -> 19.99, "foo@bar.com" -> foo, bar.com).
#  3. Inside a token, ONE of . ' \u2019 (MidNumLet/Single_Quote) or : \u00b7 (MidLetter) joins two
#     letters: "don't", "men's", "o\u2019neil", "a.b.c", "x.com", "size:large" (WB6/WB7).
#     ONE of . , ; ' (MidNum/MidNumLet) joins two digits: "3.5", "1,000.5", "5'6" (WB11/WB12).
#     A letter-dot-digit or digit-dot-letter boundary breaks: "x.5" -> x, 5; "2x.5" -> 2x, 5;
#     but "1.5x" is one token (digit-dot-digit, then digit-letter). Two such characters in a
#     row break ("a..b" -> a, b), and a leading or trailing one is dropped ("'90s" -> 90s,
#     "u.s.a." -> u.s.a, ".5" -> 5, "5." -> 5).
#  4. Combining marks, soft hyphen and zero-width (non-)joiners stay inside a word (WB4) but
#     do not start one ("\u00adold" -> old); the zero-width space breaks.
#  5. Each Han ideograph and each Hiragana character is a token of its own; a run of Katakana is
#     one token and does not join letters; a run of Thai/Lao/Myanmar/Khmer/... letters is one
#     token.
#  6. Emoji (Unicode Extended_Pictographic, e.g. \u2764 \u2122 \u00ae \u2605 and U+1F300..)
#     are tokens of their own, with any variation selector, skin-tone modifier or
#     zero-width-joiner sequence that follows them; a pair of regional indicators is one flag.
#  7. Superscript digits, vulgar fractions and circled numbers (\u00b2 \u00bd \u2460 ...,
#     Unicode "No") are not word characters and are dropped.
#  8. Tokens longer than 255 characters are cut into 255-character pieces.
#
# Known gaps (absent from the WebShop data or without effect on it): Hebrew double-quote joins
# (WB7b/c), Katakana/connector joins, keycap emoji ("1\ufe0f\u20e3"), and Unicode-version
# differences in the letter classes (Python's ``str`` classes versus Lucene's JFlex tables).

_HAN = (
    "\u2e80-\u2e99\u2e9b-\u2ef3\u2f00-\u2fd5\u3005\u3007\u3021-\u3029\u3038-\u303b"
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
)
_HIRAGANA = "\u3041-\u3096\u309d-\u309f\U0001b001-\U0001b11e\U0001b150-\U0001b152"
_KATAKANA = (
    "\u3031-\u3035\u309b\u309c\u30a0-\u30fa\u30fc-\u30ff\u31f0-\u31ff\u32d0-\u32fe"
    "\u3300-\u3357\uff66-\uff9d\U0001b000\U0001b164-\U0001b167"
)
_SOUTHEAST_ASIAN = (
    "\u0e01-\u0e3a\u0e40-\u0e4e\u0e81-\u0ecd\u0edc-\u0edf\u1000-\u103f\u1050-\u108f"
    "\u109a-\u109f\u1780-\u17d3\u17d7\u17dc\u17dd\u1950-\u1974\u1980-\u19df\u1a20-\u1aad"
    "\ua9e0-\ua9fe\uaa60-\uaadf\U00011700-\U0001173f"
)
# Unicode "No" numbers that Python counts as word characters but UAX #29 does not.
_OTHER_NUMBERS = (
    "\u00b2\u00b3\u00b9\u00bc-\u00be\u09f4-\u09f9\u0bf0-\u0bf2\u0f2a-\u0f33\u1369-\u137c"
    "\u2070-\u209f\u2150-\u215f\u2189\u2460-\u249b\u24ea-\u24ff\u2776-\u2793\u2cfd"
    "\u3192-\u3195\u3220-\u3229\u3248-\u324f\u3251-\u325f\u3280-\u3289\u32b1-\u32bf"
    "\U00010107-\U00010133\U0001d360-\U0001d378\U0001f100-\U0001f10c"
)
# Combining marks and format characters that continue a word (WB4 Extend/Format), approximated
# by the blocks that hold them; Indic blocks are taken whole (their letters are word characters
# anyway, their vowel signs are marks).
_EXTEND = (
    "\u00ad\u0300-\u036f\u0483-\u0489\u0591-\u05bd\u05bf\u05c1\u05c2\u05c4\u05c5\u05c7"
    "\u0610-\u061a\u064b-\u065f\u0670\u06d6-\u06dc\u06df-\u06e4\u06e7\u06e8\u06ea-\u06ed"
    "\u0900-\u0963\u0971-\u0dff\u1ab0-\u1aff\u1dc0-\u1dff\u200c\u200d\u20d0-\u20f0"
    "\ufe00-\ufe0f\ufe20-\ufe2f\uff9e\uff9f\U000e0100-\U000e01ef"
)
# Extended_Pictographic (Unicode emoji-data), as StandardTokenizer's EMOJI token type sees it.
_EMOJI = (
    "\u00a9\u00ae\u203c\u2049\u2122\u2139\u2194-\u2199\u21a9\u21aa\u231a\u231b\u2328\u2388"
    "\u23cf\u23e9-\u23f3\u23f8-\u23fa\u24c2\u25aa\u25ab\u25b6\u25c0\u25fb-\u25fe\u2600-\u2605"
    "\u2607-\u2612\u2614-\u2685\u2690-\u2705\u2708-\u2712\u2714\u2716\u271d\u2721\u2728"
    "\u2733\u2734\u2744\u2747\u274c\u274e\u2753-\u2755\u2757\u2763-\u2767\u2795-\u2797"
    "\u27a1\u27b0\u27bf\u2934\u2935\u2b05-\u2b07\u2b1b\u2b1c\u2b50\u2b55\u3030\u303d\u3297"
    "\u3299\U0001f000-\U0001f0ff\U0001f10d-\U0001f10f\U0001f12f\U0001f16c-\U0001f171"
    "\U0001f17e\U0001f17f\U0001f18e\U0001f191-\U0001f19a\U0001f1ad-\U0001f1e5"
    "\U0001f201-\U0001f20f\U0001f21a\U0001f22f\U0001f232-\U0001f23a\U0001f23c-\U0001f23f"
    "\U0001f249-\U0001f53d\U0001f546-\U0001f64f\U0001f680-\U0001f6ff\U0001f774-\U0001f77f"
    "\U0001f7d5-\U0001f7ff\U0001f80c-\U0001f80f\U0001f848-\U0001f84f\U0001f85a-\U0001f85f"
    "\U0001f888-\U0001f88f\U0001f8ae-\U0001f8ff\U0001f90c-\U0001f93a\U0001f93c-\U0001f945"
    "\U0001f947-\U0001fffd"
)
_EMOJI_TAIL = "\ufe0f\U0001f3fb-\U0001f3ff\U000e0020-\U000e007f"
_REGIONAL_INDICATOR = "\U0001f1e6-\U0001f1ff"
_CONNECTOR = "_\u203f\u2040\u2054\ufe33\ufe34\ufe4d-\ufe4f\uff3f"  # ExtendNumLet
_MID_LETTER = ":\u00b7\u0387\u05f4\u2027\ufe13\ufe55\uff1a"  # joins letters only
_MID_NUM_LET = ".'\u2018\u2019\u2024\ufe52\uff07\uff0e"  # joins letters or digits
_MID_NUM = ",;\u037e\u0589\u060c\u060d\u066c\u07f8\u2044\ufe10\ufe14\ufe50\ufe54\uff0c\uff1b"

# (U+FF9E/U+FF9F, halfwidth kana sound marks, are letters to Python but Extend to UAX #29)
_NOT_LETTER = _HAN + _HIRAGANA + _KATAKANA + _SOUTHEAST_ASIAN + _OTHER_NUMBERS + _EMOJI + "\uff9e\uff9f"
_LETTER_START = rf"(?![{_NOT_LETTER}])[^\W\d_]"  # a letter that can start a word
_LETTER = rf"(?:{_LETTER_START}|[{_EXTEND}])"  # ... or a mark continuing one
_LETTER_BEFORE = rf"(?:(?<=[^\W\d_])|(?<=[{_EXTEND}]))"  # the previous char is a letter or mark
_DIGIT_BEFORE = r"(?<=\d)"
_WORD = (
    rf"[{_CONNECTOR}]*(?:{_LETTER_START}|\d)"
    rf"(?:{_LETTER}|\d|[{_CONNECTOR}]"
    rf"|{_LETTER_BEFORE}[{_MID_LETTER}{_MID_NUM_LET}](?={_LETTER})"
    rf"|{_DIGIT_BEFORE}[{_MID_NUM}{_MID_NUM_LET}](?=\d))*"
)
_EMOJI_SEQ = (
    rf"[{_REGIONAL_INDICATOR}]{{2}}"
    rf"|[{_EMOJI}][{_EMOJI_TAIL}]*(?:\u200d[{_EMOJI}][{_EMOJI_TAIL}]*)*"
)
_TOKEN_RE = re.compile(
    rf"(?P<emoji>{_EMOJI_SEQ})"
    rf"|(?P<han>[{_HAN}{_HIRAGANA}])"
    rf"|(?P<kana>[{_KATAKANA}][{_KATAKANA}{_EXTEND}]*)"
    rf"|(?P<sea>[{_SOUTHEAST_ASIAN}]+)"
    rf"|(?P<word>{_WORD})"
)


def tokenize(text: str) -> list[str]:
    """Split ``text`` into tokens the way Lucene's ``StandardTokenizer`` does (approximately).

    Case is kept; no token is removed. The rules and their known gaps are listed above this
    function in the module source.

    Args:
        text: any string.

    Returns:
        The tokens in text order, each at most ``MAX_TOKEN_LENGTH`` characters.
    """
    out: list[str] = []
    for m in _TOKEN_RE.finditer(text):
        tok = m.group()
        if len(tok) <= MAX_TOKEN_LENGTH:
            out.append(tok)
        else:
            out.extend(tok[i : i + MAX_TOKEN_LENGTH] for i in range(0, len(tok), MAX_TOKEN_LENGTH))
    return out


# --------------------------------------------------------------------------------------------
# Analyzer: possessive filter, lower case, stop words, Porter stemmer

_POSSESSIVE_APOSTROPHES = ("'", "\u2019", "\uff07")


def _strip_possessive(token: str) -> str:
    # EnglishPossessiveFilter: drop a trailing 's / 'S written with ' or \u2019 or \uff07.
    if len(token) >= 2 and token[-1] in "sS" and token[-2] in _POSSESSIVE_APOSTROPHES:
        return token[:-2]
    return token


def _lower(token: str) -> str:
    # LowerCaseFilter lowers code point by code point (Java Character.toLowerCase): no final-sigma
    # context and U+0130 becomes a plain "i", unlike Python's str.lower().
    if token.isascii():
        return token.lower()
    return "".join("i" if c == "\u0130" else c.lower() for c in token)


@functools.lru_cache(maxsize=1)
def _porter():
    try:
        from nltk.stem.porter import PorterStemmer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "the WebShop search analyzer needs nltk (pip install nltk) for Porter's stemmer"
        ) from e
    return PorterStemmer(mode=PorterStemmer.MARTIN_EXTENSIONS)


@functools.lru_cache(maxsize=1 << 18)
def _stem(token: str) -> str:
    # Lucene's PorterStemFilter runs Martin Porter's reference implementation, which departs from
    # the published algorithm in three places: words of one or two characters are left alone,
    # step 2 maps "-bli" to "-ble" (the paper: "-abli" to "-able") and adds "-logi" to "-log".
    # NLTK's MARTIN_EXTENSIONS mode is that implementation; Snowball's "porter" (PyStemmer) is
    # the published one and differs on e.g. "assembly" (assembli vs assembl) and "technology".
    if len(token) <= 2:
        return token
    return _porter().stem(token, to_lowercase=False)


def analyze(text: str) -> list[str]:
    """Index/query terms of ``text``: Anserini's ``DefaultEnglishAnalyzer`` chain.

    StandardTokenizer (:func:`tokenize`) -> EnglishPossessiveFilter (drops a trailing ``'s``,
    also with ``\u2019``) -> LowerCaseFilter -> StopFilter (:data:`ENGLISH_STOP_WORDS`) ->
    PorterStemFilter (Porter's reference implementation, via NLTK's ``MARTIN_EXTENSIONS``).
    Pyserini 0.17's ``LuceneSearcher`` analyzes both documents and queries this way
    (Anserini ``SimpleSearcher`` / ``IndexCollection`` defaults: ``-stemmer porter``, default
    stop words). Over the 1,000-product data this reproduces Lucene's terms exactly for every
    document and every goal text.

    Args:
        text: a document or a query.

    Returns:
        The terms in text order; repeated terms are kept (they count once per occurrence both
        in document term frequencies and in queries).

    Raises:
        ImportError: nltk is not installed.
    """
    out: list[str] = []
    for tok in tokenize(text):
        tok = _lower(_strip_possessive(tok))
        if tok and tok not in ENGLISH_STOP_WORDS:
            out.append(_stem(tok))
    return out


# --------------------------------------------------------------------------------------------
# Lucene's document-length norm: one byte per document (SmallFloat.intToByte4 / byte4ToInt)

_NUM_FREE_VALUES = 24  # lengths below this are stored exactly


def lucene_encode_length(length: int) -> int:
    """Lucene's one-byte norm of a field that has ``length`` terms (``SmallFloat.intToByte4``).

    Lengths 0..23 are stored as they are; above that, ``length - 24`` is stored as a tiny float
    with a 4-bit mantissa, so e.g. 40 and 41 share one code and 300 is read back as 280.

    Args:
        length: number of terms (tokens after analysis), >= 0.

    Returns:
        The code, 0..255.

    Raises:
        ValueError: ``length`` is negative.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if length < _NUM_FREE_VALUES:
        return length
    v = length - _NUM_FREE_VALUES
    if v < 8:
        code = v
    else:
        shift = v.bit_length() - 4
        code = ((shift + 1) << 3) | ((v >> shift) & 0x7)
    return min(_NUM_FREE_VALUES + code, 255)


def lucene_decode_length(code: int) -> int:
    """The length BM25 uses for a norm code (``SmallFloat.byte4ToInt``): at most the true length.

    Args:
        code: a norm code, 0..255.

    Returns:
        The decoded length in terms.

    Raises:
        ValueError: ``code`` is outside 0..255.
    """
    if not 0 <= code <= 255:
        raise ValueError(f"code must be in 0..255, got {code}")
    if code < _NUM_FREE_VALUES:
        return code
    c = code - _NUM_FREE_VALUES
    shift = (c >> 3) - 1
    v = c & 0x7 if shift < 0 else ((c & 0x7) | 0x8) << shift
    return _NUM_FREE_VALUES + v


# --------------------------------------------------------------------------------------------
# Default backend: bm25s with Lucene's scoring


def _lucene_bm25_class():
    try:
        import bm25s
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("BM25Search needs bm25s (pip install bm25s)") from e

    class LuceneNormBM25(bm25s.BM25):
        """bm25s retriever whose score matrix is built as Lucene 8/9's ``BM25Similarity`` scores.

        bm25s's own "lucene" method uses the exact document length and the mean over all
        documents; Lucene uses the one-byte norm (:func:`lucene_decode_length`), averages over
        documents that have at least one term, and computes in 32-bit floats. The override point
        is bm25s's documented ``build_index_from_ids``; retrieval (summing the columns of the
        query's terms, once per occurrence) is bm25s's.
        """

        def build_index_from_ids(
            self, unique_token_ids, corpus_token_ids, show_progress=True, leave_progress=False
        ):
            self.nonoccurrence_array = None  # only BM25L/BM25+ use it
            n_docs = len(corpus_token_ids)
            n_vocab = len(unique_token_ids)
            lengths = np.fromiter((len(d) for d in corpus_token_ids), dtype=np.int64, count=n_docs)
            doc_count = int(np.count_nonzero(lengths))  # Lucene's docCount: docs with the field
            rows = np.repeat(np.arange(n_docs, dtype=np.int64), lengths)
            cols = np.fromiter(
                (t for d in corpus_token_ids for t in d), dtype=np.int64, count=int(lengths.sum())
            )
            # unique (term, doc) pairs in column-major order, with their term frequencies
            keys, tf = np.unique(cols * n_docs + rows, return_counts=True)
            term, doc = keys // n_docs, keys % n_docs
            df = np.bincount(term, minlength=n_vocab)
            f32 = np.float32
            idf = np.log(1.0 + (doc_count - df + 0.5) / (df + 0.5)).astype(f32)
            avgdl = f32(lengths.sum() / doc_count) if doc_count else f32(1.0)
            table = np.array([lucene_decode_length(c) for c in range(256)], dtype=f32)
            codes = np.array([lucene_encode_length(int(n)) for n in lengths], dtype=np.int64)
            # Lucene's per-norm cache and BM25Scorer.score, in float32 arithmetic as Lucene does
            k1, b = f32(self.k1), f32(self.b)
            inv_norm = f32(1.0) / (k1 * ((f32(1.0) - b) + b * table / avgdl))
            weight = idf[term]
            x = tf.astype(f32) * inv_norm[codes[doc]]
            term_scores = weight - weight / (f32(1.0) + x)
            # Lucene adds clause scores in double and rounds the sum to float; keep float64 here
            # so bm25s's column sums do the same (the caller rounds).
            data = term_scores.astype(np.float64)
            indptr = np.zeros(n_vocab + 1, dtype=np.int64)
            np.cumsum(df, out=indptr[1:])
            return {
                "data": data,
                "indices": doc.astype(np.dtype(self.int_dtype)),
                "indptr": indptr,
                "num_docs": n_docs,
            }

    return LuceneNormBM25


class BM25Search:
    """BM25 product search that ranks as upstream's pyserini/Lucene index does (no Java needed).

    Scoring is Lucene 8+ ``BM25Similarity`` with Anserini's defaults k1=0.9, b=0.4:
    ``score(q, d) = sum over query terms t (each occurrence) of idf(t) * tf / (tf + k1 * (1 - b +
    b * dl / avgdl))`` with ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, dl = the document's
    term count after Lucene's lossy one-byte encoding, N and avgdl over documents with at least
    one term. A query is run as upstream's bag of words (Anserini ``BagOfWordsQueryGenerator``:
    one SHOULD clause per analyzed query token), so a repeated query term adds its score again.
    Only documents sharing at least one term with the query are hits; hits are ordered by score,
    ties by asin ascending (Anserini sorts on score, then the ``id`` field).

    Follows ``web_agent_site/engine/engine.py`` (``init_search_engine``,
    ``get_top_n_product_from_keywords``: ``search_engine.search(query, k=50)``).

    Args:
        docs: ``(asin, contents)`` pairs, ``contents`` as built by :func:`document_text`.
        k1: BM25 k1 (default :data:`K1`).
        b: BM25 b (default :data:`B`).

    Raises:
        ValueError: ``docs`` is empty or repeats an asin.
        ImportError: bm25s or nltk is not installed.
    """

    def __init__(self, docs: Sequence[tuple[str, str]], *, k1: float = K1, b: float = B) -> None:
        docs = list(docs)
        if not docs:
            raise ValueError("BM25Search needs at least one document")
        self.asins: list[str] = [asin for asin, _ in docs]
        if len(set(self.asins)) != len(self.asins):
            raise ValueError("BM25Search: docs repeat an asin")
        vocab: dict[str, int] = {}
        corpus_ids = [
            [vocab.setdefault(t, len(vocab)) for t in analyze(contents)] for _, contents in docs
        ]
        self._bm25 = _lucene_bm25_class()(k1=k1, b=b, method="lucene", dtype="float64")
        self._bm25.index((corpus_ids, vocab), create_empty_token=False, show_progress=False)
        # tie-break key: the asin's rank in string order
        order = sorted(range(len(self.asins)), key=self.asins.__getitem__)
        self._asin_rank = np.empty(len(order), dtype=np.int64)
        self._asin_rank[order] = np.arange(len(order))

    def __len__(self) -> int:
        return len(self.asins)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query``.

        Args:
            query: free text, analyzed with :func:`analyze`.

        Returns:
            float32 array of shape ``(len(self),)`` in document order; 0 where no term matches.
        """
        ids = self._bm25.get_tokens_ids(analyze(query))
        if not ids:
            return np.zeros(len(self.asins), dtype=np.float32)
        return self._bm25.get_scores_from_ids(ids).astype(np.float32)

    def search_with_scores(self, query: str, k: int = SEARCH_RETURN_N) -> list[tuple[str, float]]:
        """The top ``k`` hits of ``query`` with their scores.

        Args:
            query: free text (upstream passes ``' '.join(keywords)``).
            k: the most hits to return, >= 0.

        Returns:
            ``[(asin, score), ...]``, best first, ties by asin ascending; fewer than ``k`` when
            fewer documents share a term with the query, empty when none does.

        Raises:
            ValueError: ``k`` is negative.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        s = self.scores(query)
        hit = np.flatnonzero(s > 0)
        if k == 0 or hit.size == 0:
            return []
        if hit.size > k:  # keep everything scoring at least the k-th best score (ties included)
            kth = np.partition(s[hit], hit.size - k)[hit.size - k]
            hit = hit[s[hit] >= kth]
        top = hit[np.lexsort((self._asin_rank[hit], -s[hit]))][:k]
        return [(self.asins[i], float(s[i])) for i in top]

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[str]:
        """The asins of the top ``k`` hits of ``query`` (see :meth:`search_with_scores`)."""
        return [asin for asin, _ in self.search_with_scores(query, k)]

    def search_batch(self, queries: Iterable[str], k: int = SEARCH_RETURN_N) -> list[list[str]]:
        """:meth:`search` for each query, in order."""
        return [self.search(q, k) for q in queries]


# --------------------------------------------------------------------------------------------
# Optional backend: real Lucene through pyserini (needs Java)


class PyseriniUnavailableError(RuntimeError):
    """pyserini or the Java runtime it needs is missing; the message says what to install."""


_PYSERINI_HINT = (
    "pip install pyserini==0.22.1 (or upstream's 0.17.0; importing it also needs torch, "
    "transformers, faiss-cpu, onnxruntime, scikit-learn, pandas and pyjnius) and a Java runtime "
    "(both versions run on Java 17, e.g. apt-get install openjdk-17-jre-headless)"
)


def _check_java() -> None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return
    if shutil.which("java") is None:
        raise PyseriniUnavailableError(
            f"no Java runtime found (java not on PATH, JAVA_HOME unset); {_PYSERINI_HINT}"
        )


class PyseriniSearch:
    """Search an upstream-style Lucene index with pyserini's ``LuceneSearcher`` (BM25, k1=0.9, b=0.4).

    This is what upstream runs (``web_agent_site/engine/engine.py``: ``init_search_engine`` opens
    ``LuceneSearcher(indexes_X)``; ``get_top_n_product_from_keywords`` calls
    ``search(' '.join(keywords), k=50)`` and reads each hit's ``id``). Upstream pins
    pyserini 0.17 (Lucene 8); 0.22.1 (Lucene 9) returns the same hits. Both run on Java 17.
    An index must be opened with a pyserini whose Lucene is as new as the one that wrote it.

    Args:
        index_dir: a directory written by :func:`build_pyserini_index` (or upstream's
            ``run_indexing.sh``).

    Raises:
        PyseriniUnavailableError: pyserini cannot be imported or no Java runtime is found.
        FileNotFoundError: ``index_dir`` does not exist.
    """

    def __init__(self, index_dir: str | os.PathLike) -> None:
        if not Path(index_dir).is_dir():
            raise FileNotFoundError(f"no Lucene index at {index_dir}")
        _check_java()
        try:
            from pyserini.search.lucene import LuceneSearcher
        except Exception as e:  # ImportError, or jnius failing to start the JVM
            raise PyseriniUnavailableError(
                f"cannot import pyserini ({e!r}); {_PYSERINI_HINT}"
            ) from e
        self._searcher = LuceneSearcher(str(index_dir))

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[str]:
        """The asins (Lucene ``id`` field) of the top ``k`` hits of ``query``, best first.

        Raises:
            ValueError: ``k`` is negative.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k == 0:
            return []
        return [hit.docid for hit in self._searcher.search(query, k=k)]

    def search_batch(self, queries: Iterable[str], k: int = SEARCH_RETURN_N) -> list[list[str]]:
        """:meth:`search` for each query, in order."""
        return [self.search(q, k) for q in queries]


def build_pyserini_index(
    docs: Sequence[tuple[str, str]],
    index_dir: str | os.PathLike,
    *,
    python: str | os.PathLike | None = None,
    threads: int = 1,
) -> Path:
    """Write ``docs`` as a pyserini JsonCollection and index it as upstream's ``run_indexing.sh``.

    Writes ``{"id": asin, "contents": contents}`` lines (``search_engine/
    convert_product_file_format.py``) to a temporary folder and runs
    ``python -m pyserini.index.lucene --collection JsonCollection --input DIR --index INDEX_DIR
    --generator DefaultLuceneDocumentGenerator --threads 1 --storePositions --storeDocvectors
    --storeRaw`` (``search_engine/run_indexing.sh``).

    Args:
        docs: ``(asin, contents)`` pairs.
        index_dir: where the Lucene index goes (created; an existing index there is replaced).
        python: the interpreter that has pyserini (default: this one), e.g. a separate venv's.
        threads: indexing threads (upstream: 1).

    Returns:
        ``Path(index_dir)``.

    Raises:
        PyseriniUnavailableError: no Java runtime, or ``python`` cannot import pyserini.
        RuntimeError: the indexer failed (the message ends with its output).
    """
    _check_java()
    python = str(python or sys.executable)
    index_dir = Path(index_dir)
    probe = subprocess.run(
        [python, "-c", "import pyserini.index.lucene"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise PyseriniUnavailableError(
            f"{python} cannot import pyserini.index.lucene: "
            f"{probe.stderr.strip()[-500:]}; {_PYSERINI_HINT}"
        )
    with tempfile.TemporaryDirectory(prefix="webshop-collection-") as tmp:
        with open(Path(tmp, "docs.jsonl"), "w", encoding="utf-8") as f:
            for asin, contents in docs:
                f.write(json.dumps({"id": asin, "contents": contents}) + "\n")
        if index_dir.exists():
            shutil.rmtree(index_dir)
        cmd = [
            python, "-m", "pyserini.index.lucene",
            "--collection", "JsonCollection",
            "--input", tmp,
            "--index", str(index_dir),
            "--generator", "DefaultLuceneDocumentGenerator",
            "--threads", str(threads),
            "--storePositions", "--storeDocvectors", "--storeRaw",
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        output = (run.stdout + run.stderr)[-2000:]
        raise RuntimeError(f"pyserini indexing failed ({run.returncode}): {output}")
    return index_dir


# --------------------------------------------------------------------------------------------
# Agreement between two backends


def agreement(default, reference, queries: Sequence[str], k: int = SEARCH_RETURN_N) -> dict:
    """How closely ``default`` reproduces ``reference``'s rankings over ``queries``.

    Args:
        default: a backend with ``search_batch(queries, k) -> list[list[str]]``
            (e.g. :class:`BM25Search`).
        reference: the same kind of object (e.g. :class:`PyseriniSearch`), or a precomputed
            ``list[list[str]]`` of its hits, one list per query.
        queries: the query texts.
        k: depth compared for ``jaccard_at_k`` and ``exact_top_k`` (default 50).

    Returns:
        A dict of floats in [0, 1] (fractions or means over queries) plus ``n_queries``:
        ``top1`` (the first hit is the same; both empty counts as the same), ``exact_top10``
        (the first 10 hits are the same list, in order), ``set_top10`` (the same set of first 10),
        ``overlap_at_10`` (mean ``|A10 & B10| / 10``), ``jaccard_at_k`` (mean
        ``|Ak & Bk| / |Ak | Bk|``, 1 when both are empty), ``exact_top_k``.

    Raises:
        ValueError: ``queries`` is empty, or the precomputed reference has another length.
    """
    queries = list(queries)
    if not queries:
        raise ValueError("agreement needs at least one query")
    a = default.search_batch(queries, k)
    b = reference if isinstance(reference, list) else reference.search_batch(queries, k)
    if len(b) != len(queries):
        raise ValueError(f"reference has {len(b)} result lists for {len(queries)} queries")
    n = len(queries)
    top1 = exact10 = set10 = overlap10 = jac = exactk = 0.0
    for x, y in zip(a, b):
        x, y = list(x)[:k], list(y)[:k]
        top1 += x[:1] == y[:1]
        exact10 += x[:10] == y[:10]
        set10 += set(x[:10]) == set(y[:10])
        overlap10 += len(set(x[:10]) & set(y[:10])) / 10
        union = set(x) | set(y)
        jac += len(set(x) & set(y)) / len(union) if union else 1.0
        exactk += x == y
    return {
        "n_queries": n,
        "top1": top1 / n,
        "exact_top10": exact10 / n,
        "set_top10": set10 / n,
        "overlap_at_10": overlap10 / n,
        "jaccard_at_k": jac / n,
        "exact_top_k": exactk / n,
    }
