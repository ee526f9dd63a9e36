"""experiment=longtail: its SFT targets (what the Actor is warm-started to imitate) have heavy-tailed lengths,
median ~30 tokens, p99 >= 8x the median, capped at generator.max_new_tokens=512; its Reward model (and so the
Critic) is larger than the Actor. The length law is tested on the generated SFT targets, not on a trained Actor
(a warm start takes minutes here); the trainer logs the Actor's own lengths every iteration
(`response_length/p50`, `response_length/p99`)."""

import torch

from rlhfuse.data.synthetic import SyntheticTask
from rlhfuse.trainer import compose_config, validate


def test_longtail_sft_lengths_are_long_tailed_and_the_reward_model_is_larger():
    cfg = compose_config(["experiment=longtail"])
    validate(cfg)
    cap = cfg.generator.sampling.max_new_tokens
    assert cap == 512
    task = SyntheticTask(
        seed=cfg.seed,
        max_new_tokens=cap,
        length_median=cfg.data.length_median,
        length_sigma=cfg.data.length_sigma,
        phrase_length=cfg.data.phrase_length,
    )
    # tokens = words + EOS, as the warm start encodes them
    lengths = torch.tensor(
        [len(r.split()) + 1 for _, r in task.sft_examples(cfg.model.warmstart.sft_examples)],
        dtype=torch.float64,
    )
    p50, p99 = float(lengths.quantile(0.5)), float(lengths.quantile(0.99))
    assert 25 <= p50 <= 35, p50
    assert p99 >= 8 * p50, (p50, p99)
    assert lengths.max() <= cap and lengths.min() >= 2
    m = cfg.model
    assert m.reward_hidden_size > m.hidden_size and m.reward_num_layers > m.num_layers
    assert m.reward_intermediate_size > m.intermediate_size
    # responses are repeated phrases from the topic's phrase book
    prompt, response = task.sft_examples(1)[0]
    on_topic, off_topic = task.phrase_book(prompt.split()[-2])
    phrases = {" ".join(p) for p in on_topic + off_topic}
    words = response.split()
    assert all(" ".join(words[i : i + 6]) in phrases for i in range(0, len(words) - 5, 6))
