"""The shipped environments (`agent.env=<name>`): the guessing game answers higher / lower until found."""

from __future__ import annotations

from rlhfuse.agents import GuessingGame, load_environment, run_episode


def _guesses(*texts: str):
    replies = iter(texts)
    return lambda messages: next(replies)


def test_the_guessing_game_answers_higher_and_lower_until_found() -> None:
    assert load_environment("guess") is GuessingGame
    prompt = [{"role": "user", "content": "Guess my number between 1 and 100."}]
    episode = run_episode(
        GuessingGame(), {"secret": 42}, prompt, _guesses("50", "no idea", "My guess: 30", "42"), max_turns=6,
        tools_runner=None,
    )  # fmt: skip
    replies = [m["content"] for m in episode.messages if m["role"] == "user"][1:]
    assert replies == ["Lower.", "Answer with one whole number between 1 and 100.", "Higher."]
    assert episode.rewards == [0.0, 0.0, 0.0, 1.0] and episode.ended == "done"
    # without a `secret` field the number is drawn from the row: the same for the same row, within the range
    secrets = set()
    for row in ({"prompt": "a"}, {"prompt": "a"}, {"prompt": "b"}):
        game = GuessingGame()
        assert game.reset(row) == []
        secrets.add((row["prompt"], game.secret))
        assert 1 <= game.secret <= 100
    assert len(secrets) == 2
    cut = run_episode(
        GuessingGame(), {"secret": 7}, prompt, _guesses("1", "2"), max_turns=2, tools_runner=None
    )
    assert cut.ended == "max_turns" and cut.total_reward == 0.0
