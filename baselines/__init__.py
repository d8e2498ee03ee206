"""Baselines: configurations of the one training loop (see :mod:`crl_bench.methods`)."""

from crl_bench.baselines.casebank import CASEBANK  # noqa: F401 - public re-export
from crl_bench.baselines.expel import EXPEL  # noqa: F401 - public re-export
from crl_bench.baselines.grpo import GRPO  # noqa: F401 - public re-export
from crl_bench.baselines.reflexion import REFLEXION  # noqa: F401 - public re-export
from crl_bench.baselines.static import STATIC  # noqa: F401 - public re-export
