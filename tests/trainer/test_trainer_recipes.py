"""The user-facing recipes run: the default one from compose(), the HF one from transformers-made checkpoints."""

import importlib.util
import json
from pathlib import Path

import pytest

from rlhfuse.data.synthetic import SyntheticTask, build_tokenizer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_recipe_runs_from_a_script(tmp_path, capsys):
    history = _recipe("ppo_default").main(
        ["experiment=smoke", f"model.warmstart.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"]
    )
    assert len(history) == 3
    assert "best mean reward" in capsys.readouterr().out
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_hf_recipe_trains_from_transformers_checkpoints_and_a_jsonl_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    sft, reward = tmp_path / "sft", tmp_path / "rm"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).save_pretrained(sft)
    transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(num_labels=1, **common)
    ).save_pretrained(reward)
    tokenizer.save(sft)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": p}) + "\n" for p in SyntheticTask().prompts(8)))
    run = tmp_path / "run"
    history = _recipe("ppo_hf").main(
        [
            f"--actor={sft}",
            f"--reward={reward}",
            f"--prompts={prompts}",
            "--prompt-key=text",
            f"--run-dir={run}",
            "iterations=2",
            "data.prompts_per_iteration=2",
            "data.samples_per_prompt=2",
            "data.mini_batch_size=4",
            "data.micro_batch_size=2",
            "generator.max_new_tokens=6",
            "logger=quiet",
        ]
    )
    assert len(history) == 2 and all(r["response_length/max"] <= 6 for r in history)
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / "actor_hf")
    assert exported.config.num_hidden_layers == 1


def test_the_smollm2_dapo_recipe_is_dapo_on_the_real_model_experiment(monkeypatch):
    """Composed only (the run itself needs `make real-model` and minutes: the note gives a measured run)."""
    from rlhfuse.trainer import compose_config

    monkeypatch.syspath_prepend(str(RECIPES))  # the recipe imports its sibling, as `python recipes/...` does
    recipe = _recipe("dapo_smollm2")
    config = compose_config(recipe.DAPO_SMOLLM2)
    # algorithm=dapo is GRPO's group baseline (name grpo) with DAPO's loss keys, dynamic sampling the rollout's
    assert (config.experiment, config.algorithm.name, config.data.oversample) == ("smollm2_arith", "grpo", 1)
    assert (config.algorithm.clip_eps_high, config.algorithm.loss_agg) == (0.28, "token-mean")
    assert config.algorithm.overlong_buffer == 0.2
    # the experiment's settings for a pretrained policy stay
    assert (config.algorithm.kl_loss_coef, config.pipeline.optim.actor_lr) == (0.04, 1e-6)
    assert config.eval.every == 5 and config.eval.split_fraction == 0.1


def test_the_calculator_recipe_trains_tool_calling_episodes_evaluated_before_and_after(tmp_path, capsys):
    """At smoke size (the 20-iteration run and its accuracy are in docs/agents.md): the held-out evaluation runs
    before the first iteration too (iteration 0), and the episodes call the embedded task's calculator."""
    history = _recipe("calculator_arithmetic").main(
        [
            "iterations=2",
            "eval.every=2",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_layers=1",
            "model.warmstart.sft_steps=20",
            "model.warmstart.rm_steps=2",
            "model.warmstart.sft_examples=256",
            "model.warmstart.rm_pairs=32",
            "data.num_prompts=40",
            "data.prompts_per_iteration=4",
            "data.mini_batch_size=8",
            "data.micro_batch_size=8",
            f"model.warmstart.cache_dir={tmp_path / 'cache'}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    assert [row["iteration"] for row in history] == [0, 1, 2]
    assert (
        set(history[0]) >= {"eval/reward/mean", "eval/response_length/mean"}
        and "reward/mean" not in history[0]
    )
    assert "eval/reward/mean" in history[2] and "eval/reward/mean" not in history[1]
    for row in history[1:]:
        assert 0.0 <= row["agent/tool_calls"] and 1.0 <= row["agent/turns_mean"] <= 2.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert "held-out reward" in capsys.readouterr().out


def test_evaluating_before_training_needs_the_periodic_evaluation():
    from rlhfuse.trainer import compose_config, validate

    with pytest.raises(ValueError, match=r"eval.before_training=true .* eval.every > 0"):
        validate(compose_config(["experiment=calculator", "eval.before_training=true"]))
    config = compose_config(["experiment=calculator"])
    assert (config.data.source, config.agent.env, config.agent.max_turns) == ("calculator", "calculator", 2)
    assert config.inferencer.reward_fn is None and not config.inferencer.use_reward_model


def test_the_guessing_game_recipe_is_the_game_on_the_real_model(monkeypatch):
    """Composed only (the run needs `make real-model` and tens of minutes: docs/agents.md gives a measured run)."""
    from rlhfuse.trainer import compose_config, validate

    monkeypatch.syspath_prepend(str(RECIPES))  # the recipe imports its sibling, as `python recipes/...` does
    config = compose_config(_recipe("guess_smollm2").GUESS_SMOLLM2)
    assert (config.experiment, config.data.source, config.agent.env) == ("guess_smollm2", "guess", "guess")
    assert config.model.name == "hf" and config.model.sft_path.endswith("smollm2-135m-instruct")
    assert config.eval.before_training and config.eval.every == 5
    # data.source=guess has no warm start: without a model it is refused in one line naming the experiment
    with pytest.raises(ValueError, match="experiment=guess_smollm2"):
        validate(compose_config(["data.source=guess", "agent.env=guess"]))
