"""Plain GRPO baseline: no experience bank, no extractor, the whole group is experience-free.

DESIGN.md section 1 ("Plain GRPO baseline"); GRPO as in DeepSeekMath (Shao et al. 2024, section 4.1).
"""

from crl_bench.methods import MethodSpec, register_method

GRPO = MethodSpec(
    name="grpo",
    description="GRPO on outcome rewards; groups of G rollouts per task, no experience",
    uses_experience=False,
    trains_extractor=False,
)
register_method(GRPO)
