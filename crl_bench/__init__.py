"""crl-bench: environments, rollout and trainer for Complementary RL."""
__version__ = "0.1.0"
