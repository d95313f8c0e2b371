"""Reinforcement learning on SPRINT rollouts: P-GRPO with the acceleration reward (ThreadWeaver,
Lian et al., arXiv 2512.07843, section 4). reward.py (rewards, group advantages), rollout.py
(orchestrator runs with their sampled tokens), layout.py (units as a token trie), loss.py (the
clipped surrogate and the sharded update), trainer.py (the loop), cli.py (`sprint-jax rl`)."""
