"""PPO from local Hugging Face checkpoints (LLaMA / Qwen2 families) and a local prompt file.

    python recipes/ppo_hf.py --actor /ckpt/sft --reward /ckpt/rm --prompts prompts.jsonl --run-dir runs/hf \
        generator.max_new_tokens=256 data.prompts_per_iteration=16

--actor: an SFT checkpoint folder (config.json, model.safetensors, tokenizer.json); Actor and Ref load from it.
--reward: a reward model folder (XForSequenceClassification, num_labels=1); the Reward model and, unless
--critic is given, the Critic load from it.
--prompts: a .jsonl file of {"prompt": "..."} rows (or .parquet with a `prompt` column; --prompt-key to change).
Any further arguments are Hydra overrides of the `hf_local` experiment (conf/experiment/hf_local.yaml).
Nothing is downloaded: every path is local.
"""

from __future__ import annotations

import argparse

from rlhfuse.trainer import build_trainer, compose_config


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--actor", required=True, help="SFT checkpoint folder (Actor and Ref)")
    parser.add_argument("--reward", required=True, help="reward model checkpoint folder")
    parser.add_argument("--critic", default=None, help="Critic initialisation (default: the reward model)")
    parser.add_argument("--prompts", required=True, help="local .jsonl or .parquet prompt file")
    parser.add_argument("--prompt-key", default="prompt")
    parser.add_argument("--run-dir", default="outputs/ppo-hf")
    args, overrides = parser.parse_known_args(argv)
    config = compose_config(
        [
            "experiment=hf_local",
            f"model.sft_path={args.actor}",
            f"model.reward_path={args.reward}",
            f"data.path={args.prompts}",
            f"data.prompt_key={args.prompt_key}",
            *([f"model.critic_path={args.critic}"] if args.critic else []),
            *overrides,
        ]
    )
    history = build_trainer(config, run_dir=args.run_dir).fit()
    print(
        f"reward {history[0]['reward/mean']:+.3f} -> {history[-1]['reward/mean']:+.3f}; actor in {args.run_dir}/actor_hf"
    )
    return history


if __name__ == "__main__":
    main()
