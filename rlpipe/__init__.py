"""rlpipe: a reproducible, config-driven DVC + MLflow pipeline for RL post-training of language models.

The library by role (README, Layout): config, data, models, rollout, rewards, algorithms, train, stages.
"""
