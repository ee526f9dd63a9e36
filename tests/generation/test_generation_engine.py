"""GenerationEngine: tokens equal a plain per-sample, step-by-step, no-cache sampling loop with the same streams
(greedy and sampled; prefix sharing on/off; few slots = continuous batching), equal SamplingGenerator's, stop
conditions, slot reuse, and the running batch size shrinking as samples leave."""

from typing import ClassVar

import pytest
import torch

from rlhfuse.core.sampling import SamplingConfig, filter_logits, sample_from
from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for, to_rollout
from rlhfuse.generation.batched import SamplingGenerator
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.data import assert_same_rollout

EOS, PAD = 2, 0
PROMPTS = {7: [1, 5, 6, 7, 8], 11: [1, 9], 3: [1, 10, 11, 12], 4: [1, 13, 5]}
N_SAMPLES, SEED, MAX_NEW = 3, 5, 12


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, **overrides
    )
    return Transformer(config, head="lm").eval()


def _batch(ids):
    width = max(len(PROMPTS[i]) for i in ids)
    input_ids = torch.full((len(ids), width), PAD)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, i in enumerate(ids):
        input_ids[b, width - len(PROMPTS[i]) :] = torch.tensor(PROMPTS[i])
        mask[b, width - len(PROMPTS[i]) :] = 1
    return PromptBatch(input_ids, mask, torch.tensor(ids))


def _params(stops=(EOS,), **kw):
    return SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stops, **kw)


# greedy decoding of a random model rarely meets one stop token: more of them make lengths long-tailed
GREEDY = dict(temperature=0.0, stops=(EOS, 6, 10, 14, 18, 21))


@torch.no_grad()
def _reference(model, params, ids, iteration=0):
    """One sample at a time, full recomputation of every prefix (no cache, no batch), same RNG streams."""
    out = {}
    for request in requests_for(_batch(ids), samples_per_prompt=N_SAMPLES, seed=SEED, iteration=iteration):
        seq = request.prompt_P.tolist()
        tokens: list[int] = []
        uniforms = request.uniforms(params.max_new_tokens)
        while len(tokens) < params.max_new_tokens:
            logits_V = model(torch.tensor([seq + tokens]))[0, -1]
            if params.temperature == 0:
                token = int(logits_V.argmax())
            else:
                probs = filter_logits(
                    logits_V[None], temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
                )
                token = int(sample_from(probs, torch.tensor([uniforms[len(tokens)]], dtype=torch.float64))[0])
            tokens.append(token)
            if token in params.stop_token_ids:
                break
        out[(request.prompt_index, request.sample_index)] = tokens
    return out


def _run_engine(engine, ids, iteration=0):
    requests = requests_for(_batch(ids), samples_per_prompt=N_SAMPLES, seed=SEED, iteration=iteration)
    engine.add(requests)
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert sorted(r.row for r in finished) == list(range(len(requests)))
    return {(r.prompt_index, r.sample_index): r.tokens for r in finished}, finished


SAMPLED = dict(temperature=1.0, top_k=12, top_p=0.9, stops=(EOS, 6, 14))


@pytest.mark.parametrize("prefix_sharing", [True, False])
@pytest.mark.parametrize("num_slots", [12, 5])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_engine_equals_plain_step_by_step_sampling(prefix_sharing, num_slots, sampling):
    params = _params(**(GREEDY if sampling == "greedy" else SAMPLED))
    model = _model()
    ids = [7, 11, 3, 4]
    engine = GenerationEngine(
        model, params, num_slots=num_slots, max_len=5 + MAX_NEW, prefix_sharing=prefix_sharing
    )
    got, _ = _run_engine(engine, ids)
    assert got == _reference(model, params, ids)
    lengths = {len(t) for t in got.values()}
    assert len(lengths) > 2  # responses end at different steps: samples leave and (with 5 slots) others join
    if sampling == "sampled":
        assert len({tuple(t) for t in got.values()}) > 8  # samples of one prompt differ


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_a_sliding_window_engine_equals_plain_step_by_step_sampling(prefix_sharing):
    """Qwen3 with a window of 3 keys on its second layer: cached decoding, shared prompt blocks and slots reused
    mid-run give the tokens of full recomputation, long past the window."""
    params = _params(**SAMPLED)
    windowed = dict(sliding_window=3, layer_types=("full_attention", "sliding_attention"))
    model = _model(architecture="qwen3", **windowed)
    ids = [7, 11, 3, 4]
    engine = GenerationEngine(model, params, num_slots=5, max_len=5 + MAX_NEW, prefix_sharing=prefix_sharing)
    got, _ = _run_engine(engine, ids)
    assert got == _reference(model, params, ids)
    assert max(len(t) for t in got.values()) > 3 * 3


def test_a_mixture_of_experts_engine_equals_plain_step_by_step_sampling():
    """Mixtral's routing in cached decoding (one token per row and step) and in prefill gives the tokens of full
    recomputation."""
    params = _params(**SAMPLED)
    model = _model(architecture="mixtral", num_experts=4, num_experts_per_tok=2)
    ids = [7, 11, 3, 4]
    engine = GenerationEngine(model, params, num_slots=5, max_len=5 + MAX_NEW, prefix_sharing=True)
    got, _ = _run_engine(engine, ids)
    assert got == _reference(model, params, ids)


def test_vllm_refuses_a_window_on_some_layers_only_before_any_engine():
    from rlhfuse.generation.vllm_engine import check_vllm_supported

    windowed = dict(sliding_window=3, layer_types=("full_attention", "sliding_attention"))
    config = ModelConfig.tiny(architecture="qwen3", head_dim=32, **windowed)
    with pytest.raises(
        ValueError, match=r"1 of the model's 2 layers attend through a sliding window.*generator=engine"
    ):
        check_vllm_supported(config, "cpu")
    check_vllm_supported(ModelConfig.tiny(architecture="mistral", head_dim=32, sliding_window=3), "cpu")
    moe = ModelConfig.tiny(architecture="qwen3_moe", head_dim=32, num_experts=4)
    with pytest.raises(ValueError, match=r"model.architecture='qwen3_moe': generator=vllm supports"):
        check_vllm_supported(moe, "cpu")
    with pytest.raises(ValueError, match=r"gemma2 with an LM head apart from the embedding table"):
        check_vllm_supported(ModelConfig.tiny(architecture="gemma2", head_dim=32), "cpu")


def test_engine_equals_sampling_generator_and_reuses_freed_slots():
    model = _model(1)
    gen = SamplingGenerator(
        model,
        SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, top_k=12, top_p=0.9, stop_token_ids=[6, 14]),
        eos_token_id=EOS,
        pad_token_id=PAD,
        samples_per_prompt=N_SAMPLES,
        seed=SEED,
    )
    ids = [7, 11, 3, 4]
    (expected,) = list(gen.generate(_batch(ids), iteration=2))
    engine = GenerationEngine(model, _params(**SAMPLED), num_slots=4, max_len=5 + MAX_NEW)
    _, finished = _run_engine(engine, ids, iteration=2)
    rollout = to_rollout(sorted(finished, key=lambda r: r.row), PAD)
    assert_same_rollout(rollout, expected)
    # 12 samples through 4 slots: the batch never exceeds 4 and is refilled as samples leave
    assert max(engine.stats.batch_sizes) == 4 and len(engine.free_slots) == 4
    assert engine.stats.tokens == int(rollout.response_mask_BR.sum())
    assert engine.stats.tokens_per_second() > 0


def test_prefix_sharing_prefills_each_prompt_once():
    model, params = _model(), _params(**SAMPLED)
    shared = GenerationEngine(model, params, num_slots=12, max_len=5 + MAX_NEW, prefix_sharing=True)
    alone = GenerationEngine(model, params, num_slots=12, max_len=5 + MAX_NEW, prefix_sharing=False)
    a, _ = _run_engine(shared, [7, 11, 3, 4])
    b, _ = _run_engine(alone, [7, 11, 3, 4])
    assert a == b
    prompt_tokens = sum(len(PROMPTS[i]) for i in [7, 11, 3, 4])
    assert shared.stats.prefill_tokens == prompt_tokens
    assert alone.stats.prefill_tokens == N_SAMPLES * prompt_tokens


def test_running_batch_shrinks_as_samples_finish_and_stop_tokens_end_responses():
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=(EOS, 5, 6))
    engine = GenerationEngine(_model(), params, num_slots=12, max_len=5 + MAX_NEW)
    _, finished = _run_engine(engine, [7, 11, 3, 4])
    sizes = engine.stats.batch_sizes
    assert sizes == sorted(sizes, reverse=True) and sizes[0] < 12 <= len(finished)
    for r in finished:
        stops = [t for t in r.tokens if t in (EOS, 5, 6)]
        assert stops == ([r.tokens[-1]] if r.stopped else [])
        assert r.stopped or len(r.tokens) == MAX_NEW
    assert any(r.stopped for r in finished)


def test_prompt_too_long_for_the_cache_is_refused_with_the_fix():
    engine = GenerationEngine(_model(), _params(), num_slots=2, max_len=8)
    with pytest.raises(ValueError, match="larger max_len"):
        engine.add(requests_for(_batch([7]), samples_per_prompt=1, seed=0, iteration=0))


class _HostEvent:
    """`torch.cuda.Event` as the prefill timer uses it, on the host: each call logged, every region 250 ms."""

    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing

    def record(self) -> None:
        _HostEvent.log.append("record")

    def synchronize(self) -> None:
        _HostEvent.log.append("synchronize")

    def elapsed_time(self, end: "_HostEvent") -> float:
        _HostEvent.log.append("elapsed")
        return 250.0


def test_prefill_is_timed_by_device_events_read_after_the_step_reads_its_tokens(monkeypatch):
    """On a GPU the host only launches a prefill: its seconds (read by the migration mechanism's choice and
    the Rt tuner) come from CUDA events around it, read once the step has read its tokens (no extra wait);
    events stand in for CUDA's here, as a CUDA engine's timer uses them."""
    model, params = _model(), _params(**SAMPLED)
    engine = GenerationEngine(model, params, num_slots=4, max_len=5 + MAX_NEW)
    log = _HostEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    engine.prefill_timer.events = True  # a CUDA device's timer
    model.register_forward_hook(lambda module, args, out: log.append(f"forward {args[0].shape[1]}"))
    append = engine._append
    monkeypatch.setattr(
        engine,
        "_append",
        lambda request, token, logprob: log.append("read") or append(request, token, logprob),
    )
    _run_engine(engine, [7, 11, 3, 4])
    prefills = [i for i, entry in enumerate(log) if entry.startswith("forward") and entry != "forward 1"]
    assert prefills and engine.stats.prefill_seconds == pytest.approx(0.25 * len(prefills))
    for i in prefills:  # start event, the prefill, end event; read after the step's tokens
        assert log[i - 1] == "record" and log[i + 1] == "record", log[i - 1 : i + 2]
        waited = log.index("synchronize", i)
        assert "read" in log[i:waited] and log[waited + 1] == "elapsed", log[i : waited + 2]
