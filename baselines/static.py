"""Static-extractor baseline: the full Complementary RL pipeline with the extractor frozen.

The paper's static-extractor baseline (docs/method.md): the identical pipeline with the extractor never
updated; the bank is still written by the (untrained) extractor and still guides the actor.
"""

from crl_bench.methods import MethodSpec, register_method

STATIC = MethodSpec(
    name="static",
    description="GRPO actor guided by an experience bank written by a frozen extractor",
    uses_experience=True,
    trains_extractor=False,
)
register_method(STATIC)
