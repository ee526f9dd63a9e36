"""`ModelConfig`: the shape of one decoder-only transformer, and its HF mapping.

The families (`ARCHITECTURES`, one entry per Hugging Face `model_type`) differ in a few traits of one block:
which projections carry biases, whether q and k are RMS-normalised per head (Qwen3), and which layers attend
through a sliding window (Mistral: all; Qwen2 / Qwen3: those `layer_types` marks). Hugging Face `config.json`
files are read by `ModelConfig.from_hf_dict` and written by `to_hf_dict`; the field names follow HF where they
mean the same thing, so a reader of either can find the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

AttentionBackend = Literal["sdpa", "flash", "te", "exact"]
"""sdpa = torch's scaled_dot_product_attention (any device; its kernel per call: `attention.sdpa_call`); flash =
flash-attn (CUDA, fp16/bf16); te = Transformer Engine (CUDA). flash and te run unpadded causal calls themselves and
hand masked ones (padding, KV cache) to sdpa (`rlhfuse.models.attention`). exact = the whole forward batch-invariant
(`rlhfuse.models.exact`: attention, linear layers and gate activations; a CPU reference, slower)."""
ArchitectureName = Literal[
    "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral"
]
HiddenAct = Literal["silu", "gelu_pytorch_tanh"]
"""The MLP's gate activation: silu (SwiGLU) or tanh-approximated gelu (GeGLU, Gemma's)."""
LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Architecture:
    """What one model family's block is, past the shapes every family shares (LLaMA's: RMSNorm, RoPE, grouped-query
    attention, SwiGLU)."""

    hf_prefix: str
    """Hugging Face class prefix: `<prefix>ForCausalLM`, `<prefix>ForSequenceClassification`."""
    qkv_bias: Literal["always", "config"]
    """always: q/k/v carry biases whatever config.json says (Qwen2); config: `attention_bias` decides."""
    o_bias: bool
    """`attention_bias` also puts a bias on o_proj (LLaMA, Qwen3; not Qwen2, whose o_proj has none)."""
    qk_norm: bool
    """q and k are RMS-normalised over each head's channels before RoPE (Qwen3's q_norm / k_norm)."""
    window: Literal["none", "every_layer", "layer_types"]
    """Which layers attend through `sliding_window`: none (LLaMA); every_layer (Mistral); layer_types: those
    `layer_types` marks "sliding_attention" (Qwen2 / Qwen3, with `use_sliding_window`)."""
    bias_key: bool = True
    """config.json has an `attention_bias` key (Mistral's and Phi-3's have none: no projection carries one)."""
    fused: bool = False
    """Checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3): split on load into
    the separate projections every family runs, joined again on save."""
    gemma: bool = False
    """Gemma's block: embeddings scaled by sqrt(hidden_size), RMSNorm weights stored as offsets from 1 (the norm
    multiplies by 1 + w in fp32), a norm after attention and around the MLP ("sandwich" norms), GeGLU
    (`hidden_activation`), attention scaled by `query_pre_attn_scalar`, optional tanh soft-caps on the attention
    scores and the logits."""
    window_switch: bool = False
    """config.json's `use_sliding_window` turns the windows on (Qwen2 / Qwen3 / Qwen3-MoE); without a switch
    they are always on (Mistral, Gemma)."""
    moe: Literal["none", "qwen", "mixtral"] = "none"
    """Mixture-of-experts MLPs and how checkpoints name them: qwen (Qwen3-MoE: `mlp.gate`, `mlp.experts.<e>.
    {gate,up,down}_proj`), mixtral (`block_sparse_moe.gate`, `block_sparse_moe.experts.<e>.w1/w3/w2`)."""
    value_class: str = ""
    """The sequence-classification class when it is not `<prefix>ForSequenceClassification` (Gemma 3 text's)."""

    @property
    def lm_class(self) -> str:
        return f"{self.hf_prefix}ForCausalLM"

    @property
    def value_head_class(self) -> str:
        return self.value_class or f"{self.hf_prefix}ForSequenceClassification"


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("Llama", qkv_bias="config", o_bias=True, qk_norm=False, window="none"),
    "qwen2": Architecture(
        "Qwen2", qkv_bias="always", o_bias=False, qk_norm=False, window="layer_types", window_switch=True
    ),
    "qwen3": Architecture(
        "Qwen3", qkv_bias="config", o_bias=True, qk_norm=True, window="layer_types", window_switch=True
    ),
    "mistral": Architecture(
        "Mistral", qkv_bias="config", o_bias=True, qk_norm=False, window="every_layer", bias_key=False
    ),
    "phi3": Architecture(
        "Phi3",
        qkv_bias="config",
        o_bias=True,
        qk_norm=False,
        window="every_layer",
        bias_key=False,
        fused=True,
    ),
    "gemma2": Architecture(
        "Gemma2", qkv_bias="config", o_bias=True, qk_norm=False, window="layer_types", gemma=True
    ),
    "gemma3_text": Architecture(
        "Gemma3",
        qkv_bias="config",
        o_bias=True,
        qk_norm=True,
        window="layer_types",
        gemma=True,
        value_class="Gemma3TextForSequenceClassification",
    ),
    "qwen3_moe": Architecture(
        "Qwen3Moe",
        qkv_bias="config",
        o_bias=True,
        qk_norm=True,
        window="every_layer",
        window_switch=True,
        moe="qwen",
    ),
    "mixtral": Architecture(
        "Mixtral",
        qkv_bias="config",
        o_bias=True,
        qk_norm=False,
        window="every_layer",
        bias_key=False,
        moe="mixtral",
    ),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
SUPPORTED_HEADS = ("lm", "value")
# rope types whose frequency table we compute; anything else (dynamic NTK, longrope, ...) is refused
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelConfig:
    """Hyper-parameters of a `Transformer`. Sizes are counts (of tokens, channels, heads, layers)."""

    architecture: ArchitectureName = "llama"
    """Model family, a key of `ARCHITECTURES` (Hugging Face's model_type): llama | qwen2 (q/k/v biases) | qwen3
    (q/k norms) | mistral (sliding-window attention) | phi3 (fused checkpoint weights)."""
    vocab_size: int = 32000
    """Number of token ids (rows of the embedding table)."""
    hidden_size: int = 4096
    """Model width D (channels of the residual stream)."""
    intermediate_size: int = 11008
    """Width of the SwiGLU MLP's hidden layer."""
    num_layers: int = 32
    """Number of decoder blocks (HF: num_hidden_layers)."""
    num_heads: int = 32
    """Number of query heads (HF: num_attention_heads)."""
    num_kv_heads: int = 32
    """Number of key/value heads; < num_heads is grouped-query attention, must divide num_heads."""
    head_dim: int | None = None
    """Channels per head; None means hidden_size // num_heads."""
    rope_theta: float = 10000.0
    """Base of the rotary-embedding frequencies."""
    rope_scaling: dict[str, Any] | None = None
    """HF rope scaling dict; None or rope_type "default" is plain RoPE, "linear", "llama3" and "yarn" are
    supported."""
    partial_rotary_factor: float = 1.0
    """Share of each head's channels RoPE rotates (the first ones; Phi-4-mini: 0.75); the rest pass unrotated."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers when it is not `rope_theta` (Gemma 3: 10000 locally, 1e6 globally;
    `rope_scaling` applies to the full-attention layers only); None = every layer uses rope_theta."""
    hidden_act: HiddenAct = "silu"
    """The MLP's gate activation (HF: hidden_act, Gemma's hidden_activation)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None = head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(scores / cap) before the softmax (Gemma 2: 50); None = uncapped."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logits / cap) (Gemma 2: 30); None = uncapped."""
    num_experts: int = 0
    """Experts of each mixture-of-experts MLP (Qwen3-MoE, Mixtral); 0 = dense MLPs only."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k of the router's softmax)."""
    moe_intermediate_size: int | None = None
    """Each expert's MLP width; None = intermediate_size (Mixtral's experts, Qwen3-MoE's dense layers)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (Mixtral always; Qwen3-MoE: its config)."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is a mixture of experts (Qwen3-MoE)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers kept dense in a mixture-of-experts model (Qwen3-MoE)."""
    router_aux_loss_coef: float = 0.0
    """The checkpoint's suggested load-balancing loss weight (config.json's router_aux_loss_coef), kept for the
    export; training applies `pipeline.router_aux_loss_coef`."""
    rms_norm_eps: float = 1e-6
    """Epsilon added to the mean square inside RMSNorm."""
    max_position_embeddings: int = 2048
    """Longest sequence (tokens) the model was trained for; written to config.json, not enforced."""
    tie_word_embeddings: bool = False
    """Share the LM head's weight with the input embedding table."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (and on o_proj where the family puts one there); always True for qwen2,
    whose checkpoints carry them."""
    sliding_window: int | None = None
    """Keys a sliding-window layer attends to, itself included: query t sees keys t - sliding_window + 1 .. t
    (counted in real tokens); None = no layer has a window."""
    layer_types: tuple[LayerType, ...] | None = None
    """Per layer, "full_attention" or "sliding_attention" (HF's layer_types); None = every layer the same:
    sliding when sliding_window is set, full otherwise."""
    attention_backend: AttentionBackend = "sdpa"
    """Attention kernel: "sdpa" (torch, any device), "flash" (flash-attn), "te" (Transformer Engine), "exact"
    (batch-invariant, with the linears and activations: `batch_invariant`); not read from or written to
    config.json (the trainer's model.attention_backend sets it when loading)."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialisation of fresh weights."""
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_hf: dict[str, Any] = field(default_factory=dict, repr=False)
    """Keys of the source config.json we do not interpret, written back unchanged by to_hf_dict."""

    def __post_init__(self) -> None:
        family = ARCHITECTURES.get(self.architecture)
        if family is not None and family.qkv_bias == "always":
            self.attention_bias = True
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
        self.mlp_only_layers = tuple(self.mlp_only_layers)

    @property
    def family(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def batch_invariant(self) -> bool:
        """attention_backend="exact": every op of the forward gives a row the same bits whatever else is in the
        call (`rlhfuse.models.exact`), the linear layers and gate activations included."""
        return self.attention_backend == "exact"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.family.o_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys it attends to, itself included), or None for full
        attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windows(self) -> frozenset[int]:
        """The distinct sliding windows of the model's layers (empty: every layer attends fully)."""
        return frozenset(w for w in map(self.window_of, range(self.num_layers)) if w is not None)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    def validate(self) -> ModelConfig:
        """Raise one ValueError listing every problem, each with the field, the value seen and the fix."""
        from rlhfuse.models.attention import ATTENTION_BACKENDS  # the kernels (torch)

        problems: list[str] = []
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            problems.append(
                f"architecture={self.architecture!r} is not supported: use one of {SUPPORTED_ARCHITECTURES}"
            )
        elif self.family.window == "none" and self.sliding_window is not None:
            problems.append(
                f"sliding_window={self.sliding_window}: architecture={self.architecture!r} has no sliding-window "
                "layers; use mistral, qwen2 or qwen3 for windowed attention, or set it to None"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            problems.append(f"sliding_window={self.sliding_window!r} must be a positive integer or None")
        if self.layer_types is not None:
            unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if len(self.layer_types) != self.num_layers or unknown:
                problems.append(
                    f"layer_types has {len(self.layer_types)} entries{f' (unknown {unknown})' if unknown else ''}: "
                    f"give one of {LAYER_TYPES} per layer ({self.num_layers})"
                )
            elif self.architecture in ARCHITECTURES and self.family.window == "every_layer":
                if "full_attention" in self.layer_types:
                    problems.append(
                        f"layer_types marks full-attention layers, but {self.architecture} windows every layer: "
                        "leave layer_types unset"
                    )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        if self.num_heads > 0 and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                "(grouped-query attention shares each kv head among num_heads // num_kv_heads query heads)"
            )
        if self.head_dim is None and self.num_heads > 0 and self.hidden_size % self.num_heads:
            problems.append(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}: "
                "set head_dim explicitly"
            )
        if self.resolved_head_dim <= 0 or self.resolved_head_dim % 2:
            problems.append(
                f"head_dim={self.resolved_head_dim} must be a positive even number (rotary pairs)"
            )
        if self.rope_theta <= 0:
            problems.append(f"rope_theta={self.rope_theta} must be > 0")
        if self.rms_norm_eps <= 0:
            problems.append(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            problems.append(
                f"rope_scaling type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}); "
                "use a checkpoint without rope_scaling or with one of these types"
            )
        elif self.rope_type == "linear" and not (self.rope_scaling or {}).get("factor"):
            problems.append(f"rope_scaling={self.rope_scaling} of type 'linear' needs a 'factor'")
        elif self.rope_type == "llama3":
            missing = {
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            } - set(self.rope_scaling or {})
            if missing:
                problems.append(f"rope_scaling of type 'llama3' lacks {sorted(missing)}")
        elif self.rope_type == "yarn" and "original_max_position_embeddings" not in (self.rope_scaling or {}):
            problems.append(
                f"rope_scaling={self.rope_scaling} of type 'yarn' needs 'original_max_position_embeddings'"
            )
        for key in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "local_rope_theta",
        ):
            value = getattr(self, key)
            if value is not None and not value > 0:
                problems.append(f"{key}={value!r} must be > 0 or None")
        if self.num_experts < 0 or (
            self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts
        ):
            problems.append(
                f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}: each token needs "
                "between 1 and num_experts experts"
            )
        if self.num_experts and self.architecture in ARCHITECTURES and self.family.moe == "none":
            problems.append(
                f"num_experts={self.num_experts}: architecture={self.architecture!r} has dense MLPs; use "
                "qwen3_moe or mixtral"
            )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            problems.append(f"hidden_act={self.hidden_act!r} is unknown: use 'silu' or 'gelu_pytorch_tanh'")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            problems.append(
                f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and rotate an even number of "
                f"channels (head_dim {self.resolved_head_dim} x factor = {self.resolved_head_dim * self.partial_rotary_factor})"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(
                f"attention_backend={self.attention_backend!r} is unknown: use one of {sorted(ATTENTION_BACKENDS)}"
            )
        if problems:
            raise ValueError("invalid ModelConfig:\n  - " + "\n  - ".join(problems))
        return self

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A small model for tests: vocab 128, width 64, 2 layers, 4 query heads sharing 2 kv heads."""
        base = cls(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=256,
        )
        return replace(base, **overrides).validate()

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config model_type={model_type!r} is not supported: rlhfuse.models loads {SUPPORTED_ARCHITECTURES}"
            )
        family = ARCHITECTURES[model_type]
        problems = []
        act_key = "hidden_activation" if family.gemma else "hidden_act"
        hidden_act: Any = d.get(act_key) or ("gelu_pytorch_tanh" if family.gemma else "silu")
        allowed_acts = ("gelu_pytorch_tanh",) if family.gemma else ("silu",)
        if hidden_act not in allowed_acts:
            problems.append(f"{act_key}={hidden_act!r} (this family runs {allowed_acts[0]!r} only)")
        if d.get("router_jitter_noise"):
            problems.append(f"router_jitter_noise={d['router_jitter_noise']} (the router's training noise)")
        if d.get("use_bidirectional_attention"):
            problems.append(
                "use_bidirectional_attention=true (an embedding model's attention; not a causal LM)"
            )
        if d.get("mlp_bias", False):
            problems.append("mlp_bias=true (MLP biases are not implemented)")
        if d.get("pretraining_tp", 1) != 1:
            problems.append(f"pretraining_tp={d['pretraining_tp']} (only 1 is implemented)")
        rope_parameters = d.get("rope_parameters") or {}
        local_rope_theta = None
        if family.gemma and model_type == "gemma3_text":
            # Gemma 3: one rope per layer type (transformers 5), or rope_local_base_freq beside rope_theta (4.x)
            local = rope_parameters.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                problems.append(
                    f"rope_parameters.sliding_attention={local} (the local layers' rope must be default)"
                )
            local_rope_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
            if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:
                rope_parameters = rope_parameters.get("full_attention") or {}
        rope_theta = rope_parameters.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling")
        own = ("rope_theta", "partial_rotary_factor")  # fields of their own, not of the scaling
        if rope_parameters and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_parameters.items() if k not in own}
        partial_rotary_factor = rope_parameters.get(
            "partial_rotary_factor", d.get("partial_rotary_factor", 1.0)
        )
        if problems:
            raise ValueError("unsupported config.json settings: " + "; ".join(problems))
        # transformers' Gemma 2 class defaults, for config.json files that leave them out
        caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
        known = {
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
            "rope_parameters", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id",
            "architectures", "num_labels", "id2label", "label2id", "transformers_version", "use_sliding_window",
            "sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor", "hidden_act",
            "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
            "rope_local_base_freq", "sliding_window_pattern", "use_bidirectional_attention", "num_experts",
            "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "router_jitter_noise",
            "output_router_logits",
        }  # fmt: skip
        moe = family.moe != "none"
        sliding_window, layer_types = _windows_from_hf(ARCHITECTURES[model_type], d)
        num_heads = d["num_attention_heads"]
        eos: Any = d.get("eos_token_id")
        # several HF checkpoints list many eos ids; the first is the one generation stops on by default
        eos_token_id: int | None = eos[0] if isinstance(eos, list) and eos else eos
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim"),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            partial_rotary_factor=float(partial_rotary_factor),
            local_rope_theta=local_rope_theta,
            hidden_act=hidden_act,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256 if family.gemma else None),
            attn_logit_softcapping=d.get("attn_logit_softcapping", caps[0]),
            final_logit_softcapping=d.get("final_logit_softcapping", caps[1]),
            num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
            moe_intermediate_size=d.get("moe_intermediate_size") if family.moe == "qwen" else None,
            # Mixtral always renormalises; transformers' Qwen3-MoE class defaults to not
            norm_topk_prob=bool(d.get("norm_topk_prob", False)) if family.moe == "qwen" else True,
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            sliding_window=sliding_window,
            layer_types=layer_types,
            initializer_range=d.get("initializer_range", 0.02),
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_token_id,
            extra_hf={k: v for k, v in d.items() if k not in known},
        ).validate()

    def to_hf_dict(self, head: str) -> dict[str, Any]:
        """A config.json dict that `transformers` loads as XForCausalLM (head="lm") or
        XForSequenceClassification with num_labels=1 (head="value")."""
        if head not in SUPPORTED_HEADS:
            raise ValueError(f"head={head!r} is unknown: use one of {SUPPORTED_HEADS}")
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {
                **self.rope_scaling,
                "rope_type": self.rope_type,
                "rope_theta": self.rope_theta,
            }
        if self.partial_rotary_factor != 1.0:
            rope_parameters["partial_rotary_factor"] = self.partial_rotary_factor
        d: dict[str, Any] = {
            **self.extra_hf,
            "architectures": [self.family.lm_class if head == "lm" else self.family.value_head_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.resolved_head_dim,
            "hidden_act": self.hidden_act,
            # both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta / rope_scaling
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family.bias_key and self.family.qkv_bias == "config":
            d["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            d["mlp_bias"] = False
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.family.gemma:
            d["hidden_activation"] = self.hidden_act
            d["query_pre_attn_scalar"] = self.query_pre_attn_scalar
            d["attn_logit_softcapping"] = self.attn_logit_softcapping
            d["final_logit_softcapping"] = self.final_logit_softcapping
        if self.family.moe != "none":
            d["num_local_experts" if self.family.moe == "mixtral" else "num_experts"] = self.num_experts
            d["num_experts_per_tok"] = self.num_experts_per_tok
            d["router_aux_loss_coef"] = self.router_aux_loss_coef
            if self.family.moe == "qwen":
                d["moe_intermediate_size"] = self.expert_intermediate_size
                d["norm_topk_prob"] = self.norm_topk_prob
                d["decoder_sparse_step"] = self.decoder_sparse_step
                d["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.local_rope_theta is not None:
            local = {"rope_type": "default", "rope_theta": self.local_rope_theta}
            d["rope_parameters"] = {"full_attention": rope_parameters, "sliding_attention": local}
            d["rope_local_base_freq"] = self.local_rope_theta
        if self.family.window == "every_layer":
            d["sliding_window"] = self.sliding_window
            if self.family.window_switch:
                d["use_sliding_window"] = self.sliding_window is not None
        elif self.family.window == "layer_types":
            types = [
                "full_attention" if self.window_of(i) is None else "sliding_attention"
                for i in range(self.num_layers)
            ]
            if self.family.window_switch:
                d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = types
            # transformers 4.x reads this instead of layer_types: the leading full-attention layers
            d["max_window_layers"] = next(
                (i for i, t in enumerate(types) if t == "sliding_attention"), self.num_layers
            )
        if head == "value":
            d["num_labels"] = 1
            d["id2label"] = {"0": "LABEL_0"}
            d["label2id"] = {"LABEL_0": 0}
        return d


def _windows_from_hf(family: Architecture, d: dict[str, Any]) -> tuple[int | None, tuple[Any, ...] | None]:
    """(sliding_window, layer_types) of a config.json dict, read as transformers reads it for the family."""
    if family.window == "none":
        return None, None
    if family.window == "every_layer":
        on = d.get("use_sliding_window", False) if family.window_switch else True
        return (d.get("sliding_window") if on else None), None
    if not family.window_switch:  # Gemma: windowed layers always; 4.x configs give the pattern instead
        window, types = d.get("sliding_window"), d.get("layer_types")
        if types is None:
            every = d.get("sliding_window_pattern", 6 if family.qk_norm else 2)
            types = [
                "sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(d["num_hidden_layers"])
            ]
        return window, tuple(types)
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    types = d.get("layer_types")
    if types is None:
        # transformers 4.x: layers from max_window_layers on are windowed
        first = d.get("max_window_layers", d["num_hidden_layers"])
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(d["num_hidden_layers"])
        ]
    return window, tuple(types)
