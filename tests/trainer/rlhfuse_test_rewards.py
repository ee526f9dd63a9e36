"""User-side reward functions named by import path in tests (`rlhfuse_test_rewards:...`; pytest puts tests/trainer on sys.path).

Each takes a batch of `rlhfuse.core.rewards.RewardSample` and returns one score per sample."""


def constant_reward(samples, responses=None):
    # also callable the pre-issue-14 way, (prompts, responses): test_import_paths_resolve_only_when_named...
    return [0.5 for _ in (samples if responses is None else responses)]


def nan_reward(samples):
    return [float("nan") for _ in samples]


def raising_reward(samples):
    for s in samples:
        if s.sample_index == 1:
            raise ZeroDivisionError("division by zero")
    return [0.0 for _ in samples]


def short_reward(samples):
    return [0.0 for _ in samples[1:]]


def distinct_tokens(samples):
    """A score that differs between a random model's samples: the share of distinct tokens in the response."""
    return [len(set(s.response_ids)) / max(len(s.response_ids), 1) for s in samples]
