"""The pool around a rollout and a weight sync: only a training rollout lets the instances release their memory
(a sync always follows it; vLLM's level-2 sleep keeps nothing to reload from), and a streamed sync is read
bucket by bucket into every instance's copy."""

import torch

from rlhfuse.core.sampling import Sampling, SamplingConfig
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation.generation_config import GenerationConfig
from rlhfuse.generation.generator import EngineGenerator, EnginePool, InstanceSetup
from rlhfuse.generation.migration import NoMigration
from rlhfuse.models import ModelConfig, Transformer


class CountingPool(EnginePool):
    rests = 0

    def rest(self) -> None:
        self.rests += 1


def test_only_a_training_rollout_rests_the_pool_and_a_sync_streams_into_every_copy() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=24), head="lm").eval()
    config = GenerationConfig(name="engine", sampling=SamplingConfig(max_new_tokens=3), instances=2)
    pool = CountingPool(model, config.engine)
    setup = InstanceSetup(2, 0, samples_per_prompt=2, seed=0, policy=NoMigration(), bs_max=4)
    generator = EngineGenerator(pool, config, setup, mechanism="reprefill")
    prompts = PromptBatch(
        torch.tensor([[1, 5, 7], [1, 9, 10]]), torch.ones(2, 3, dtype=torch.long), torch.arange(2)
    )
    list(generator.generate(prompts, iteration=1))
    assert pool.rests == 1
    evaluation = Sampling(SamplingConfig(max_new_tokens=3, temperature=0.0), samples_per_prompt=1)
    list(generator.generate(prompts, iteration=1, sampling=evaluation))
    assert pool.rests == 1  # the next rollout may come before any sync: nothing released

    new = {k: v + 1.0 for k, v in model.state_dict().items()}
    read: list[str] = []

    def buckets():
        for name in sorted(new):
            read.append(name)
            yield {name: new[name]}

    generator.load_weight_buckets(buckets())
    assert read == sorted(new)
    assert len(pool.actor_copies()) == 2
    for copy in pool.actor_copies():
        state = copy.state_dict()
        assert all(torch.equal(state[k], new[k]) for k in new)
