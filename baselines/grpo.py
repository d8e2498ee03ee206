"""Plain GRPO baseline: no experience bank, no extractor, the whole group is experience-free.

The paper's plain-GRPO baseline (docs/method.md); GRPO as in DeepSeekMath (Shao et al. 2024, section 4.1).
Declared with the other methods in :mod:`crl_bench.methods`.
"""

from crl_bench.methods import GRPO

__all__ = ["GRPO"]
