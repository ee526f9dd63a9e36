"""The generation copy's dtype under pipeline.precision: bf16 weights and a bf16 KV cache under bf16-mixed (the
trained Actor stays fp32), weight sync casting into it, the 32-true tokens unchanged; and TF32 switched on only
for CUDA devices."""

from __future__ import annotations

import pytest
import torch

from rlhfuse.core.optim import generation_dtype, resolve_precision
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import ModelConfig, Transformer, cast_copy
from rlhfuse.trainer import build_trainer, compose_config
from rlhfuse.trainer.build import allow_tf32, prepare_generation_copy
from rlhfuse.trainer.models import Models


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart-cache"))


def _trainer(tmp_path, cache_dir, *overrides):
    cfg = compose_config(["experiment=smoke", f"model.warmstart.cache_dir={cache_dir}", *overrides])
    return build_trainer(cfg, run_dir=tmp_path, log=lambda _: None), cfg


def _record_cache_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []

    def hook(_module, _args, kwargs):
        if kwargs.get("cache") is not None:
            seen.append(kwargs["cache"].dtype)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _prompts() -> PromptBatch:
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    return PromptBatch(ids, mask, torch.tensor([0, 1]))


@pytest.mark.parametrize("generator", ["sampling", "engine"])
def test_bf16_mixed_generates_in_a_bf16_copy_with_a_bf16_cache(tmp_path, cache_dir, generator):
    trainer, _ = _trainer(tmp_path, cache_dir, "pipeline.precision=bf16-mixed", f"generator={generator}")
    actor = trainer.strategy.actor  # type: ignore[attr-defined]
    (copy,) = trainer.generator.actor_copies()
    assert next(actor.parameters()).dtype == torch.float32  # training numerics: fp32 weights, autocast
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    seen = _record_cache_dtypes(copy)
    rollouts = list(trainer.generator.generate(_prompts(), iteration=0))
    assert rollouts and seen and set(seen) == {torch.bfloat16}

    # weight sync: the trained fp32 weights are cast into the bf16 copy
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.01)
    trainer.generator.load_weights(trainer.strategy.actor_weights())
    synced = dict(copy.named_parameters())
    for name, p in actor.named_parameters():
        assert synced[name].dtype == torch.bfloat16
        assert torch.equal(synced[name], p.detach().to(torch.bfloat16)), name


def test_32_true_generates_the_same_tokens_from_an_fp32_copy(tmp_path, cache_dir):
    trainer, cfg = _trainer(tmp_path, cache_dir, "pipeline.precision=32-true")
    (copy,) = trainer.generator.actor_copies()
    assert {p.dtype for p in copy.parameters()} == {torch.float32}
    seen = _record_cache_dtypes(copy)
    got = list(trainer.generator.generate(_prompts(), iteration=3))
    assert set(seen) == {torch.float32}
    # what the generator did before the generation dtype existed: a plain copy of the trained Actor
    direct = SamplingGenerator(
        trainer.strategy.actor,  # type: ignore[attr-defined]
        trainer.generator.config,  # type: ignore[attr-defined]
        eos_token_id=trainer.generator.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=trainer.pad_token_id,
        samples_per_prompt=cfg.data.samples_per_prompt,
        seed=cfg.seed,
    )
    want = list(direct.generate(_prompts(), iteration=3))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.response_ids_BR, b.response_ids_BR)
        assert torch.equal(a.response_mask_BR, b.response_mask_BR)


def test_generation_dtype_of_each_precision():
    assert resolve_precision("auto", "cuda") == "bf16-mixed" and resolve_precision("auto", "cpu") == "32-true"
    assert generation_dtype("bf16-mixed") == generation_dtype("bf16-true") == torch.bfloat16
    assert generation_dtype("32-true") == torch.float32


def test_cast_copy_keeps_ties_and_leaves_the_source_alone():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(tie_word_embeddings=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = cast_copy(model, torch.bfloat16)
    assert copy.lm_head.weight is copy.embed_tokens.weight
    assert not any(p.requires_grad for p in copy.parameters())
    for name, value in copy.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, before[name].to(torch.bfloat16))
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[name])


@pytest.fixture
def tf32_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_is_switched_on_for_cuda_devices_only(tf32_flags):
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    allow_tf32(torch.device("cpu"))
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    allow_tf32(torch.device("cuda", 0))  # only sets flags: no CUDA device needed
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn  # CPU matmuls untouched


def _models(actor: Transformer, generation: Transformer | None) -> Models:
    return Models(actor, actor, None, None, tokenizer=None, sft_path=None, generation=generation)  # type: ignore[arg-type]


def test_the_sharded_actors_generation_copy_is_cast_in_place_and_a_whole_actor_gets_a_copy():
    torch.manual_seed(0)
    config = ModelConfig.tiny()
    trained, whole = Transformer(config), Transformer(config)
    sharded = _models(trained, whole)
    prepare_generation_copy(sharded, torch.bfloat16)
    assert sharded.for_generation() is whole and next(whole.parameters()).dtype == torch.bfloat16
    assert next(trained.parameters()).dtype == torch.float32
    plain = _models(trained, None)
    prepare_generation_copy(plain, torch.bfloat16)
    assert plain.generation is not None and plain.for_generation() is not trained
    assert next(plain.for_generation().parameters()).dtype == torch.bfloat16
    assert next(trained.parameters()).dtype == torch.float32
    fp32 = _models(trained, None)
    prepare_generation_copy(fp32, torch.float32)  # 32-true: the generators copy the trained Actor, as before
    assert fp32.generation is None and fp32.for_generation() is trained
