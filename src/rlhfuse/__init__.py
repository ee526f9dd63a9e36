"""rlhfuse: fast RLHF (PPO) training with inter- and intra-stage fusion.

Implements and extends RLHFuse (Zhong et al., arXiv 2409.13221): generation fused with inference at the
sample level, and Actor/Critic training fused as two pipelines running in opposite directions.
"""

__version__ = "0.1.0"
