"""Plain GRPO baseline: no experience bank, no extractor, the whole group is experience-free.

The paper's plain-GRPO baseline (docs/method.md); GRPO as in DeepSeekMath (Shao et al. 2024, section 4.1).
"""

from crl_bench.methods import MethodSpec, register_method

GRPO = MethodSpec(
    name="grpo",
    description="GRPO on outcome rewards; groups of G rollouts per task, no experience",
    uses_experience=False,
    trains_extractor=False,
)
register_method(GRPO)
