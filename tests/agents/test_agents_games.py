"""The shipped environments (`agent.env=<name>`): the guessing game answers higher / lower until found; the
calculator offers `calc` and rewards a right final answer, in the calculator task's own words."""

from __future__ import annotations

import pytest

from rlhfuse.agents import (
    Calculator,
    Episode,
    GuessingGame,
    ToolRunner,
    calc,
    episode_tokens,
    load_environment,
    run_episode,
)
from rlhfuse.data import CalculatorTask, GuessingTask


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


def test_calc_evaluates_arithmetic_and_refuses_anything_else() -> None:
    assert (calc("7 + 5"), calc(" -3 - (2 * 4)"), calc("7 / 2"), calc("6 / 3")) == (12, -11, 3.5, 2)
    assert isinstance(calc("6 / 3"), int)  # an integral result reads as one: "2", not "2.0"
    for bad in ("__import__('os').system('true')", "2 ** 100", "x + 1", "1 +", "9" * 300):
        with pytest.raises(ValueError):
            calc(bad)
    with pytest.raises(ZeroDivisionError):
        calc("1 / (2 - 2)")
    # through the runner every failure is an answer the model reads, never an exception
    runner = ToolRunner(Calculator.tools, timeout_s=5.0)
    answers = runner.run(
        {
            "role": "assistant",
            "content": f"{CalculatorTask.tool_call('1 / 0')} {CalculatorTask.tool_call('8 - 9')}",
        }
    )
    assert [a["content"] for a in answers][1] == "-1" and "division by zero" in answers[0]["content"]


def test_the_calculator_rewards_a_right_final_answer_after_the_tool() -> None:
    assert load_environment("calculator") is Calculator
    task = CalculatorTask()
    prompt, row = task.problem(0)
    expression = f"{row['a']} {row['op']} {row['b']}"
    wrong = str(int(row["answer"]) + 1)
    runner = ToolRunner(Calculator.tools)
    used = run_episode(
        Calculator(), row, [{"role": "user", "content": prompt}],
        _guesses(task.tool_call(expression), f"answer : {row['answer']}"), max_turns=2, tools_runner=runner,
    )  # fmt: skip
    assert used.messages[2] == {"role": "tool", "name": "calc", "content": row["answer"]}
    assert (used.rewards, used.tool_calls, used.ended) == ([0.0, 1.0], 1, "done")
    direct = run_episode(
        Calculator(), row, [{"role": "user", "content": prompt}], _guesses(f"answer : {wrong}"), max_turns=2,
        tools_runner=runner,
    )  # fmt: skip
    assert (direct.rewards, direct.turns) == ([0.0], 1)
    with pytest.raises(ValueError, match="no 'answer'"):
        Calculator().reset({"prompt": prompt})


def test_the_calculator_task_writes_its_tool_calls_in_its_own_words() -> None:
    """The tokenizer reads every word of a tool-call conversation (no unknown token), decoding gives back the call,
    and the mask is 1 on the model's two messages (with their EOS) and 0 on the prompt and the tool's answer."""
    task = CalculatorTask()
    tokenizer = task.tokenizer()
    examples = task.sft_examples(64)
    prompt, response = next((p, r) for p, r in examples if "<tool_call>" in r)
    assert sum("<tool_call>" in r for _, r in examples) in range(8, 25)  # tool_rate 0.25 of 64
    unk = tokenizer.token_to_id("<unk>")
    ids = tokenizer.encode(prompt) + tokenizer.encode(response, add_bos=False)
    assert unk not in ids
    index = next(i for i, (p, _) in enumerate(examples) if p == prompt)
    row = task.problem(index)[1]
    call = task.tool_call(f"{row['a']} {row['op']} {row['b']}")
    assert tokenizer.decode(tokenizer.encode(call, add_bos=False)) == call
    episode = Episode(
        messages=[
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": call},
            {"role": "tool", "name": "calc", "content": row["answer"]},
            {"role": "assistant", "content": f"answer : {row['answer']}"},
        ],
        trainable=[False, True, False, True], rewards=[0.0, 1.0], turns=2, tool_calls=1, tool_errors=0,
        ended="done",
    )  # fmt: skip
    conversation, mask = episode_tokens(tokenizer, episode, Calculator.tools)
    assert conversation == [*ids, tokenizer.eos_id]  # what the warm start trained on, with its final EOS
    words = [tokenizer.id_to_token(i) for i in conversation]
    model_words = [w for w, m in zip(words, mask) if m]
    assert model_words == [*call.split(), "<eos>", "answer", ":", row["answer"], "<eos>"]
    assert [w for w, m in zip(words, mask) if not m] == [
        "<bos>", *prompt.split(), "<tool_response>", row["answer"], "</tool_response>"
    ]  # fmt: skip


def test_the_guessing_task_gives_each_game_its_number() -> None:
    games = GuessingTask(seed=0)
    rows = games.rows(200)
    assert rows == GuessingTask(seed=0).rows(200) and rows != GuessingTask(seed=1).rows(200)
    assert all(GuessingGame.low <= row["secret"] <= GuessingGame.high for row in rows)
    assert len({row["secret"] for row in rows}) > 50  # spread over the range, not one number
    prompt = games.problem(3)[0]
    assert prompt == games.problem(4)[0] and "between 1 and 100" in prompt
    game = GuessingGame()
    game.reset(rows[3])
    assert game.step({"role": "assistant", "content": str(rows[3]["secret"])}) == ([], 1.0, True)
