"""Reflexion baseline: the actor's verbal reflections on its failed attempts, shown to later attempts.

After a failed episode the actor writes what to do differently; later attempts at the same task are
shown the task's most recent reflections (Reflexion, arXiv 2303.11366; docs/method.md, "Reflexion").
Declared with the other methods in :mod:`crl_bench.methods`; the reflections are written by
:class:`crl_bench.experience.reflections.ReflectionWriter`.
"""

from crl_bench.methods import REFLEXION

__all__ = ["REFLEXION"]
