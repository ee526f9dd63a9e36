"""User-side reward functions named by import path in tests (`rlhfuse_test_rewards:...`; pytest puts tests/trainer on sys.path)."""


def constant_reward(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.5 for _ in responses]


def nan_reward(prompts: list[str], responses: list[str]) -> list[float]:
    return [float("nan") for _ in responses]
