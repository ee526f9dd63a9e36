"""A real pretrained model learning a verifiable task: SmolLM2-135M-Instruct under `experiment=smollm2_arith`.

    make real-model && REAL_MODEL_ITERATIONS=20 make bench BENCH=real_model

Accuracy on a fixed held-out set of 64 arithmetic prompts, greedy, before and after N GRPO iterations of
`experiment=smollm2_arith` (N = $REAL_MODEL_ITERATIONS, default 10; 1 with --quick), and the seconds per iteration
split into generation / inference / training (the trainer's `time/*` metrics, means over the iterations).

Held out means never trained on: the task has 200 distinct problems (`a op b =`, 0 <= a, b <= 9), so the bench
splits them once (seeded) into 64 held-out and 136 training problems and trains on the latter through a prompt
file (`data.source=file`, same rows and fields as `data=arithmetic`); everything else is the experiment as
shipped. A held-out answer counts as right when the response ends (EOS) within generator.max_new_tokens and its
final answer (after an answer marker, else its last number) equals the reference: the training reward,
`numeric_match`, with `inferencer.truncated_score=0`. Also printed: right ignoring the cut, and `exact_match`
(which needs an answer marker). Goal: accuracy rises by >= 10 points; the figures are reported whatever they are.
Skipped (with the command to run) when the model is not converted.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlhfuse.core.answers import exact_match, numeric_match
from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.data.arithmetic import ArithmeticTask
from rlhfuse.data.collate import collate_prompts
from rlhfuse.data.prompts import apply_prompt_template, tokenize_prompts, uses_chat_template
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import from_pretrained
from rlhfuse.models.convert import is_converted, real_model_dir
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.models import load_tokenizer

ITERATIONS_ENV = "REAL_MODEL_ITERATIONS"
HELD_OUT = 64


def split_problems(seed: int = 0) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """Every distinct problem of the task (0..9 operands), split into (held-out 64, training rest), seeded."""
    task = ArithmeticTask(seed=seed, max_operand=9)
    problems: dict[str, dict] = {}
    index = 0
    while len(problems) < 200:
        text, row = task.problem(index)
        problems.setdefault(text, row)
        index += 1
    ordered = sorted(problems.items())
    random.Random(f"real-model-bench-{seed}").shuffle(ordered)
    return ordered[:HELD_OUT], ordered[HELD_OUT:]


class HeldOut:
    """Greedy generation on the held-out prompts with a copy of the Actor; scores as the module docstring says."""

    def __init__(self, cfg, problems: list[tuple[str, dict]]) -> None:  # type: ignore[no-untyped-def]
        folder = Path(cfg.model.sft_path).expanduser()
        self.tokenizer = load_tokenizer(None, folder)
        self.problems = problems
        texts: list = [text for text, _ in problems]
        if cfg.data.prompt_template is not None:  # as the training prompts are
            texts = apply_prompt_template(
                texts, [row for _, row in problems], cfg.data.prompt_template, "held out"
            )
        prompts = tokenize_prompts(
            texts,
            self.tokenizer,
            max_length=cfg.data.max_prompt_length,
            chat=uses_chat_template(cfg.data, self.tokenizer),
        )
        self.batch = collate_prompts(prompts, self.tokenizer.pad_id)
        greedy = SamplingConfig(
            max_new_tokens=cfg.generator.sampling.max_new_tokens,
            temperature=0.0,
            stop_token_ids=list(self.tokenizer.stop_ids),
        )
        self.generator = SamplingGenerator(
            from_pretrained(folder),
            greedy,
            eos_token_id=self.tokenizer.eos_id,
            pad_token_id=self.tokenizer.pad_id,
            samples_per_prompt=1,
            seed=0,
        )

    def evaluate(self, weights) -> dict[str, float]:  # type: ignore[no-untyped-def]
        self.generator.load_weights(weights)
        right = right_uncut = exact = 0
        examples = []
        for rollout in self.generator.generate(self.batch, iteration=0):
            for b in range(len(rollout.finished_B)):
                n = int(rollout.response_mask_BR[b].sum())
                response = self.tokenizer.decode(rollout.response_ids_BR[b, :n].tolist())
                answer = self.problems[int(rollout.prompt_index_B[b])][1]["answer"]
                ok = numeric_match(response, answer) == 1.0
                right += int(ok and bool(rollout.finished_B[b]))
                right_uncut += int(ok)
                exact += int(exact_match(response, answer) == 1.0)
                if len(examples) < 3:
                    examples.append(response)
        total = len(self.problems)
        return {
            "accuracy": right / total,
            "accuracy_ignoring_cut": right_uncut / total,
            "exact_match": exact / total,
            "examples": examples,  # type: ignore[dict-item]
        }


def run(quick: bool = False) -> dict[str, Any] | None:
    """Figures: iterations, before / after (accuracy, accuracy_ignoring_cut, exact_match: fractions),
    accuracy_gain_points, seconds_per_iteration (generation, inference, training, iteration), train_reward
    (first, last); None (no results file) when the model is not converted."""
    if not is_converted():
        print(f"skipped: the real model is not converted ({real_model_dir()}); run `make real-model` first")
        return None
    iterations = int(os.environ.get(ITERATIONS_ENV, "1" if quick else "10"))
    held_out, train = split_problems()
    with tempfile.TemporaryDirectory(prefix="rlhfuse-bench-real-") as tmp:
        prompts = Path(tmp) / "train.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": text, **row}) + "\n" for text, row in train))
        cfg = compose_config(
            [
                "experiment=smollm2_arith",
                "data.source=file",
                f"data.path={prompts}",
                f"iterations={iterations}",
                "checkpoint.export_hf=false",
                "logger=quiet",
                "logger.log_samples_every=0",
            ]
        )
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        trainer = build_trainer(cfg, run_dir=Path(tmp) / "run", log=lambda _: None)
        evaluation = HeldOut(cfg, held_out)
        start = time.perf_counter()
        before = evaluation.evaluate(trainer.strategy.actor_weights())
        eval_s = time.perf_counter() - start
        history = trainer.fit()
        after = evaluation.evaluate(trainer.strategy.actor_weights())

    def mean(key: str) -> float:
        return statistics.fmean(row[key] for row in history)

    print(
        f"SmolLM2-135M-Instruct, experiment=smollm2_arith, {iterations} iteration(s) of "
        f"{cfg.data.prompts_per_iteration}x{cfg.data.samples_per_prompt} samples, lr {cfg.pipeline.optim.actor_lr:g}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"held-out set: {len(held_out)} prompts, greedy, {cfg.generator.sampling.max_new_tokens} new tokens"
    )
    for key in ("accuracy", "accuracy_ignoring_cut", "exact_match"):
        print(
            f"  {key:<22} before {before[key]:6.1%}  after {after[key]:6.1%}  ({after[key] - before[key]:+.1%})"
        )
    gain = after["accuracy"] - before["accuracy"]
    print(f"  goal: accuracy +10 points -> {'met' if gain >= 0.10 else 'not met'} ({gain * 100:+.1f} points)")
    print(
        f"seconds per iteration: generation {mean('time/generation'):.1f}, inference {mean('time/inference'):.1f}, "
        f"training {mean('time/training'):.1f}, total {mean('time/iteration'):.1f} "
        f"(one held-out evaluation: {eval_s:.1f}s)"
    )
    print(f"train reward: first {history[0]['reward/mean']:.3f}, last {history[-1]['reward/mean']:.3f}")
    print(f"held-out responses after training (first 3): {after['examples']}")
    keys = ("accuracy", "accuracy_ignoring_cut", "exact_match")
    return {
        "iterations": iterations,
        "held_out_prompts": len(held_out),
        "before": {k: before[k] for k in keys},
        "after": {k: after[k] for k in keys},
        "accuracy_gain_points": gain * 100,
        "seconds_per_iteration": {
            part: mean(f"time/{part}") for part in ("generation", "inference", "training", "iteration")
        },
        "eval_s": eval_s,
        "train_reward": {"first": history[0]["reward/mean"], "last": history[-1]["reward/mean"]},
    }
