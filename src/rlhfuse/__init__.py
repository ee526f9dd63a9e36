"""rlhfuse: fast RLHF (PPO) training with inter- and intra-stage fusion.

Implements and extends RLHFuse (Zhong et al., arXiv 2409.13221): generation fused with inference at the
sample level, and Actor/Critic training fused as two pipelines running in opposite directions.
"""

__version__ = "0.1.0"


def _reach_source_conf() -> None:
    """A source checkout keeps `conf/` at the repository root, where the wheel ships it inside the package as
    `rlhfuse/conf`: the package's search path then reaches the root too, so that `import rlhfuse.conf` and
    Hydra's `pkg://rlhfuse.conf` find the same configuration from a clone (an editable install) as from a wheel."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    shipped = os.path.isdir(os.path.join(here, "conf"))
    if not shipped and os.path.isfile(os.path.join(root, "conf", "__init__.py")):
        __path__.append(root)


_reach_source_conf()
