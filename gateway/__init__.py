"""slime-gateway: an RL rollout gateway between a slime trainer and the SGLang router."""

__version__ = "0.1.0"
