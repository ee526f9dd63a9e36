"""Shared fixtures: the Table-3 settings (shipped with the package, or $RLHFUSE_TABLE3) and small problems."""

import pytest

from rlhfuse.pipeline import make_problem
from rlhfuse.pipeline.problem import load_problems
from rlhfuse.pipeline.schedule_command import default_table_path


@pytest.fixture(scope="session")
def table3():
    return {p.name.split()[0]: p for p in load_problems(default_table_path())}


@pytest.fixture
def tiny_fused():
    """4 ranks: a 4-stage actor and two reversed 2-stage critic replicas."""
    return make_problem(
        [
            {"name": "actor", "stages": 4, "microbatches": 4, "forward": 2, "backward": 4, "activation": 1.5},
            {
                "name": "critic",
                "stages": 2,
                "microbatches": 3,
                "forward": 1,
                "backward": 2,
                "activation": 1.0,
            },
        ],
        name="tiny",
    )
