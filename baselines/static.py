"""Static-extractor baseline: the full Complementary RL pipeline with the extractor frozen.

The paper's static-extractor baseline (docs/method.md): the identical pipeline with the extractor never
updated; the bank is still written by the (untrained) extractor and still guides the actor. Declared
with the other methods in :mod:`crl_bench.methods`.
"""

from crl_bench.methods import STATIC

__all__ = ["STATIC"]
