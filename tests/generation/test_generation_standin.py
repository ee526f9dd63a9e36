"""The engine's decode loop on the stand-in device (`rlhfuse.testing.standin`, where an op mixing a CPU tensor
into device work raises as on a GPU): continuous batching with prefix sharing, speculative verification, and a
migration with the KV cache and by re-prefill (between two engines, and through the in-process `Coordinator`),
each giving the CPU's tokens."""

import pytest
import torch

from rlhfuse.core.sampling import SamplingConfig
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.generation.generation_config import GenerationConfig
from rlhfuse.generation.generator import EngineGenerator, EnginePool, InstanceSetup
from rlhfuse.generation.migration import FixedThreshold
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.data import assert_same_rollout
from rlhfuse.testing.standin import standin_device

STANDIN = standin_device()
EOS, PAD, MAX_NEW = 2, 0, 10
PARAMS = SamplingParams(
    max_new_tokens=MAX_NEW, temperature=1.0, top_k=12, top_p=0.95, stop_token_ids=(EOS, 6)
)


def _model(device: torch.device | str, **family) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, **family
    )
    model = Transformer(config, head="lm").double().eval()  # float64: drafts verify as plain decoding
    with torch.no_grad():  # peaky next-token laws: the model repeats itself and n-gram drafts get accepted
        model.lm_head.weight.mul_(40.0)
    return model.to(device)


def _prompts() -> PromptBatch:
    return PromptBatch(
        input_ids_BP=torch.tensor([[PAD, 1, 5, 7], [1, 9, 10, 11], [PAD, PAD, 1, 12]]),
        attention_mask_BP=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]),
        prompt_ids_B=torch.tensor([4, 7, 9]),
    )


def _decode(
    device: torch.device | str, speculative: str, migrate: str, **family
) -> tuple[dict[int, list[int]], int]:
    """Every sample's tokens and the draft tokens accepted: one engine of 4 slots for 9 samples; with `migrate`, after three steps two running
    samples move to a second engine (with their KV, or re-prefilled there) and both engines finish."""
    model = _model(device, **family)
    engines = [
        GenerationEngine(model, PARAMS, num_slots=4, max_len=4 + MAX_NEW, speculative=speculative)
        for _ in range(2 if migrate != "none" else 1)
    ]
    engines[0].add(requests_for(_prompts(), samples_per_prompt=3, seed=3, iteration=1))
    done = []
    for _ in range(3):
        done += engines[0].step()
    if migrate != "none":
        engines[1].admit(engines[0].evict(2, with_kv=migrate == "kv"))
    while any(e.has_work() for e in engines):
        for engine in engines:
            done += engine.step()
    assert sorted(r.row for r in done) == list(range(9))
    return {r.row: r.tokens for r in done}, sum(e.stats.spec_accepted for e in engines)


@pytest.mark.parametrize(
    "speculative, migrate", [("off", "none"), ("ngram", "none"), ("off", "kv"), ("off", "reprefill")]
)
def test_the_engine_decodes_on_the_standin_with_the_cpu_tokens(speculative, migrate) -> None:
    on_cpu, accepted = _decode("cpu", speculative, migrate)
    assert len({len(t) for t in on_cpu.values()}) > 1  # samples leave at different steps and others join
    assert (accepted > 0) == (speculative == "ngram")  # verify steps ran
    assert _decode(STANDIN, speculative, migrate) == (on_cpu, accepted)


# the families' own paths: a window past which decoding runs (masks built from the cache), Gemma's scaled
# embeddings and soft-capped scores and logits, Qwen3-MoE's routing (its counts read on the host)
FAMILIES = {
    "mistral_window": dict(architecture="mistral", sliding_window=3),
    "gemma2": dict(
        architecture="gemma2", hidden_act="gelu_pytorch_tanh", sliding_window=3, query_pre_attn_scalar=8,
        attn_logit_softcapping=5.0, final_logit_softcapping=20.0, layer_types=("sliding_attention", "full_attention"),
    ),
    "gemma3_text": dict(
        architecture="gemma3_text", hidden_act="gelu_pytorch_tanh", sliding_window=3, local_rope_theta=100.0,
        layer_types=("sliding_attention", "full_attention"),
    ),
    "qwen3_moe": dict(architecture="qwen3_moe", num_experts=4, moe_intermediate_size=16),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_decodes_on_the_standin_with_the_cpu_tokens(family) -> None:
    """Speculative verification and a KV migration on the stand-in device give the CPU's tokens for every
    family's own code path: no host tensor meets device work in them."""
    on_cpu = _decode("cpu", "ngram", "kv", **FAMILIES[family])
    assert _decode(STANDIN, "ngram", "kv", **FAMILIES[family]) == on_cpu


def _many_prompts(count: int = 6) -> PromptBatch:
    g = torch.Generator().manual_seed(1)
    rows = [[1, *torch.randint(3, 24, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()]
            for _ in range(count)]  # fmt: skip
    width = max(map(len, rows))
    ids_BP, mask_BP = torch.full((count, width), PAD), torch.zeros((count, width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids_BP[b, width - len(row) :] = torch.tensor(row)
        mask_BP[b, width - len(row) :] = 1
    return PromptBatch(ids_BP, mask_BP, torch.arange(100, 100 + count))


@pytest.mark.parametrize("mechanism", ["kv", "reprefill"])
def test_in_process_instances_migrate_on_the_standin_with_the_cpu_tokens(mechanism) -> None:
    """`EngineGenerator` with three instances in this process (`Coordinator`): 24 samples, the tail (at most 8
    left) moves to fewer instances, with its KV cache or re-prefilled, and the rollout equals the CPU's."""
    rollouts = []
    for device in ("cpu", STANDIN):
        torch.manual_seed(0)
        config = ModelConfig.tiny(
            vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
        )
        model = Transformer(config, head="lm").eval().to(device)
        sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, stop_token_ids=[6, 14])
        setup = InstanceSetup(
            eos_token_id=EOS,
            pad_token_id=PAD,
            samples_per_prompt=4,
            seed=3,
            policy=FixedThreshold(8),
            bs_max=4,
        )
        config = GenerationConfig(name="engine", sampling=sampling, instances=3)
        generator = EngineGenerator(EnginePool(model, config.engine), config, setup, mechanism=mechanism)
        (rollout,) = generator.generate(_many_prompts(), iteration=1)
        report = generator.coordinator.report
        assert report.samples_moved > 0 and report.mechanism == mechanism  # the tail did migrate
        rollouts.append(rollout)
    assert_same_rollout(rollouts[1], rollouts[0])
