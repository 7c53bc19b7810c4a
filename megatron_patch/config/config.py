"""The engine's one typed configuration: frozen dataclasses by concern, with Megatron-LM's names and defaults.

`Config` holds one frozen section per concern (`cfg.model`, `cfg.moe`, `cfg.parallel`, `cfg.numerics`,
`cfg.optimizer`, `cfg.data`, `cfg.checkpoint`, `cfg.logging`, `cfg.run`, `cfg.fusion` and the derived
`cfg.layout`). Every setting also reads by its flat Megatron-LM name (`cfg.num_layers` is `cfg.model.num_layers`):
a setting's name is unique across the sections. A changed configuration is a new one: `cfg.replace(**settings)`.

Two settings are enums instead of the flags' boolean soups: `zero_stage` (0-3; the flags
--zero-N-memory-optimization) and `precision` (fp32 / fp16 / bf16; --fp16, --bf16 and Rapidformer's
--mixed-precision, which is fp16). The flags' names still construct and read a Config (`Config(bf16=True)`,
`cfg.zero_1_memory_optimization`), so checkpoints that stored them still load.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Union

from .errors import ConfigError  # noqa: F401  (re-exported: `from megatron_patch.config.config import ConfigError`)


class Precision(str, enum.Enum):
    """The parameters' and activations' dtype (--bf16, --fp16; Rapidformer's --mixed-precision is fp16)."""
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


@dataclass(frozen=True)
class ModelConfig:
    model_family: Optional[str] = None
    model_size: Optional[str] = None
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None  # resolve(): --seq-length when not given
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    # Llama 3.1-3.3's RoPE scaling (HF rope_type "llama3"): long wavelengths divided by the factor, a smooth
    # blend between the low- and high-frequency bounds of the original context, short ones unchanged
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    qk_layernorm: bool = False  # a norm over each query and key head (Qwen3), before RoPE; MLA: its latent norms
    # Multi-latent attention (DeepSeek-V2/V3; megatron-core's MLASelfAttention): queries from the hidden state or a
    # rank-q_lora_rank latent, keys and values from one shared rank-kv_lora_rank latent, plus a RoPE part of
    # qk_pos_emb_head_dim shared by the heads; qk_head_dim is each head's part without RoPE
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "rope"  # MLA's RoPE: rope | yarn (YaRN's frequencies and softmax scaling, the fields below)
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's gelu_new) instead of the exact one
    kv_channels: Optional[int] = None  # attention head dimension; default hidden_size / num_attention_heads
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    vocab_size: Optional[int] = None  # NullTokenizer / mock data only
    # Rows of the embedding before padding: by default the tokenizer's vocabulary; a Hugging Face model's
    # config.json may say more (Qwen2), and --load-hf / a converted checkpoint sets it.
    model_vocab_size: Optional[int] = None
    # Rows of the embedding after padding, when a checkpoint fixes them (else derived, see models.gpt)
    padded_vocab_size: Optional[int] = None
    attention_backend: str = "auto"  # auto (te if importable, else sdpa) | sdpa | local | te
    bert_binary_head: bool = True  # BERT: pooler + next-sentence head (Megatron-LM's --bert-no-binary-head turns it off)
    init_layout_invariant: bool = False
    # LoRA (models/lora.py): adapters of this rank on --lora-target, the base frozen; 0 = off
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (megatron-core MoELayer; num_experts None = a dense MLP)."""
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # default --ffn-hidden-size
    # an MoE layer every N layers (1: all), or one 0/1 per layer (Megatron-LM's list form, e.g. Qwen2-MoE's
    # mlp_only_layers / decoder_sparse_step): 1 = experts, 0 = the dense MLP of --ffn-hidden-size
    moe_layer_freq: Union[int, List[int]] = 1
    moe_shared_expert_intermediate_size: Optional[int] = None  # a shared expert (every token) of this width
    moe_shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(hidden @ gate) (Qwen2-MoE)
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None  # the routed experts' weights times this (DeepSeek)
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_grouped_gemm: bool = False  # experts as two torch._grouped_mm calls (models/grouped_experts.py)


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout and the memory savers (ZeRO, recompute, offload)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # default --tensor-model-parallel-size
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    sequence_parallel: bool = False
    zero_stage: int = 0  # 0: plain DDP, 1: distributed optimizer, 2: Megatron-FSDP, 3: the front end's FSDP
    cpu_offload: bool = False
    checkpoint_activations: bool = False  # Rapidformer's name for --recompute-granularity full
    recompute_granularity: Optional[str] = None  # resolve(): full with --checkpoint-activations
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1


@dataclass(frozen=True)
class NumericsConfig:
    """Precision (an enum) and fp16 loss scaling."""
    precision: Precision = Precision.FP32
    grad_reduce_in_bf16: bool = False  # bf16 gradient buffer (accumulation and DP reduction) instead of fp32
    # FP8 GEMMs (Megatron-LM's flags): Transformer Engine's when installed, torchao's otherwise (models/float8.py)
    fp8_format: Optional[str] = None  # None: off; hybrid (e4m3 forward, e5m2 gradients) | e4m3
    fp8_recipe: str = "tensorwise"  # tensorwise | rowwise (torchao); delayed | mxfp8 | blockwise (Transformer Engine)
    fp8_layers: str = "auto"  # auto: torchao's size rule; all: every linear of the layers with dims multiple of 16
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its learning-rate schedule."""
    optimizers: str = "apex_adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # Adam's moments' dtypes (Megatron-LM's flags; bf16 needs --optimizer-step-fusion, whose kernel keeps them)
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"


@dataclass(frozen=True)
class DataConfig:
    data_path: List[str] = field(default_factory=list)
    mock_data: bool = False
    split: str = "969,30,1"
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    data_impl: str = "mmap"
    data_iterator: str = "fixed-shape"
    data_cache_path: Optional[str] = None
    eod_mask_loss: bool = False
    # Supervised fine-tuning on preprocess_data.py --sft data: loss on assistant tokens, per token over the global
    # batch; conversations packed into --seq-length samples (attention and positions per conversation) or padded
    sft: bool = False
    pack_sequences: bool = True
    calculate_per_token_loss: bool = False  # resolve(): on with --sft
    num_workers: int = 0
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # resolve(): micro batch x data-parallel size when not given
    # BERT pretraining (pretrain_megatron_bert.py; Megatron-LM's names and defaults)
    mask_prob: float = 0.15  # share of tokens the masked-LM objective predicts
    short_seq_prob: float = 0.1  # share of samples cut shorter than --seq-length


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    load_hf: Optional[str] = None  # a Hugging Face model directory: architecture and weights come from it
    no_load_optim: bool = False
    # A resume whose lr schedule flags differ from the checkpoint's is refused unless one of these says which wins
    # (Megatron-LM's flags): this run's settings, continued from the checkpoint's step, or the checkpoint's.
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    keep_last_n: Optional[int] = None
    async_save: bool = False  # write checkpoints in a background thread (training/checkpoint/async_save.py)
    dist_ckpt_optim_fully_reshardable: bool = False  # ZeRO-1 optimizer state that loads at any TP/PP (torch_dist.py)


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    metrics_file: Optional[str] = None
    moe_per_layer_logging: bool = False
    profile: bool = False  # torch.profiler over iterations (profile_step_start, profile_step_end], with a GPU-time breakdown
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_dir: str = "profile"


@dataclass(frozen=True)
class RunConfig:
    """How long the run goes, its evaluation and its stop rules."""
    train_iters: int = 100
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_on_nan: bool = True
    exit_interval: Optional[int] = None
    skip_train: bool = False
    validate_only: bool = False  # check config and data for WORLD_SIZE processes, then exit
    # Hang detection (parallel/watchdog.py): the collectives' timeout (Megatron-LM's flag and default), a worker's
    # missing heartbeat, and optionally a step that never ends
    distributed_timeout_minutes: float = 10.0
    heartbeat_timeout_seconds: float = 60.0
    step_timeout_minutes: Optional[float] = None


@dataclass(frozen=True)
class FusionConfig:
    """Kernel choices: compilation and fused operations (same numbers, other kernels)."""
    compile: bool = False
    compile_mode: str = "default"  # torch.compile mode of --compile; reduce-overhead: CUDA graphs per layer
    gradient_accumulation_fusion: bool = False  # weight gradients accumulated straight into the gradient buffer
    optimizer_step_fusion: bool = False  # bf16 Adam step, one Triton launch per param group (training/fused_adam.py)
    # Megatron-LM's switches of a fused loss: native/te fuse the softmax cross entropy of the logits (megatron-core's
    # own implementations), linear also the output layer, so the full logits never exist (models/linear_cross_entropy.py),
    # triton: our Triton kernels over the logits (models/triton_cross_entropy.py)
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"  # native | te | linear | triton


@dataclass(frozen=True)
class LayoutConfig:
    """Derived by resolve() from the world size: never given as flags."""
    world_size: int = 1
    data_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    num_microbatches: int = 1
    # validate() passed for this world size: the process-group set-up does not check the same settings again.
    # Any change (replace) clears it, and it is never stored with a checkpoint.
    checked: bool = False


SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig, "numerics": NumericsConfig,
            "optimizer": OptimizerConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
            "logging": LoggingConfig, "run": RunConfig, "fusion": FusionConfig, "layout": LayoutConfig}
# flat setting name -> its section
HOME: Dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
assert len(HOME) == sum(len(fields(c)) for c in SECTIONS.values()), "a setting name is in two sections"
ZERO_FLAGS = {1: "zero_1_memory_optimization", 2: "zero_2_memory_optimization", 3: "zero_3_memory_optimization"}
# The flags' boolean names, accepted as settings and read as views of the two enums
FLAG_NAMES = ("bf16", "fp16", "mixed_precision", *ZERO_FLAGS.values())


def _enums(flat: Dict[str, Any]) -> None:
    """Turn the flags' booleans in `flat` into `precision` / `zero_stage` (in place); refuse contradictions."""
    zero = [n for n, name in ZERO_FLAGS.items() if flat.pop(name, False)]
    if len(zero) > 1:
        raise ConfigError(f"choose one ZeRO stage, not {' and '.join(f'--zero-{z}-memory-optimization' for z in zero)}")
    if zero:
        flat["zero_stage"] = zero[0]
    bf16, fp16, mixed = (bool(flat.pop(n, False)) for n in ("bf16", "fp16", "mixed_precision"))
    if mixed and bf16:  # Rapidformer's --mixed-precision is fp16 training; bf16 is the explicit --bf16
        raise ConfigError("--mixed-precision means fp16 and cannot be combined with --bf16; pass only one of them")
    if fp16 and bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive; pass only one")
    if bf16 or fp16 or mixed:
        flat["precision"] = Precision.BF16 if bf16 else Precision.FP16
    if "precision" in flat:
        flat["precision"] = Precision(flat["precision"])


@dataclass(frozen=True, init=False)
class Config:
    """Every pretraining setting; see the module docstring. `Config(num_layers=4, bf16=True)` takes flat settings
    (and the flags' boolean names); `Config(model=ModelConfig(...))` whole sections."""
    model: ModelConfig
    moe: MoEConfig
    parallel: ParallelConfig
    numerics: NumericsConfig
    optimizer: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    run: RunConfig
    fusion: FusionConfig
    layout: LayoutConfig

    def __init__(self, **settings: Any):
        sections = {k: settings.pop(k) for k in list(settings) if k in SECTIONS}
        _enums(settings)
        unknown = sorted(set(settings) - set(HOME))
        if unknown:
            raise TypeError(f"Config has no setting {', '.join(unknown)}")
        for name, cls in SECTIONS.items():
            part = {k: v for k, v in settings.items() if HOME[k] == name}
            base = sections.get(name)
            value = (replace(base, **part) if part else base) if base is not None else cls(**part)
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: a flat setting name reads through its section
        section = HOME.get(name)
        if section is None:
            raise AttributeError(f"Config has no setting {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def replace(self, **settings: Any) -> "Config":
        """A copy with these flat settings changed (the flags' boolean names too); a changed configuration is an
        unchecked one."""
        settings.setdefault("checked", False)
        return Config(**{name: getattr(self, name) for name in SECTIONS}, **settings)

    def to_flat(self) -> Dict[str, Any]:
        """Every setting by its flat name (what a checkpoint stores: JSON values; precision as its name)."""
        out = {name: getattr(getattr(self, HOME[name]), name) for name in HOME if name != "checked"}
        out["precision"] = self.precision.value
        return out

    @classmethod
    def from_flat(cls, stored: Dict[str, Any]) -> "Config":
        """The Config of a stored flat dict (a checkpoint's, of any version): settings it does not know are left out."""
        return cls(**{k: v for k, v in stored.items() if (k in HOME or k in FLAG_NAMES) and k != "checked"})

    # ---- views of the enums by the flags' names
    @property
    def zero_stage(self) -> int:
        return self.parallel.zero_stage

    @property
    def zero_1_memory_optimization(self) -> bool:
        return self.parallel.zero_stage == 1

    @property
    def zero_2_memory_optimization(self) -> bool:
        return self.parallel.zero_stage == 2

    @property
    def zero_3_memory_optimization(self) -> bool:
        return self.parallel.zero_stage == 3

    @property
    def bf16(self) -> bool:
        return self.numerics.precision is Precision.BF16

    @property
    def fp16(self) -> bool:
        return self.numerics.precision is Precision.FP16

    @property
    def mixed_precision(self) -> bool:
        """Rapidformer's --mixed-precision: fp16 training."""
        return self.numerics.precision is Precision.FP16

    @property
    def params_dtype_name(self) -> str:
        return self.numerics.precision.value

    # ---- derived values
    @property
    def virtual_pipeline_model_parallel_size(self) -> Optional[int]:
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        return self.num_layers // (self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage)

    @property
    def expert_tp_size(self) -> int:
        """The experts' tensor-parallel size: --expert-tensor-parallel-size, else the dense layers' TP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_ffn_size(self) -> int:
        """The experts' hidden size: --moe-ffn-hidden-size, else --ffn-hidden-size, else 4 x --hidden-size."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def decay_iters(self) -> int:
        """Iterations of learning-rate decay: --lr-decay-iters, else --train-iters."""
        return self.lr_decay_iters or self.train_iters

    @property
    def warmup_iters(self) -> int:
        """Warmup iterations: --lr-warmup-fraction of the decay iterations, else --lr-warmup-iters. Computed from
        the final flags, so a launcher can give a fraction as its default whatever --train-iters ends up being."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * self.decay_iters)
        return self.lr_warmup_iters

    def moe_layers(self) -> List[int]:
        """Global numbers (from 0) of the layers with experts: megatron-core's moe_layer_freq rule (every N-th
        layer from layer 0, or the 1s of a list); none for a dense model."""
        if not self.num_experts:
            return []
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [i for i in range(self.num_layers) if i % freq == 0]
        return [i for i, on in enumerate(freq) if on]

    def validate(self, world_size: int) -> "Config":
        """The entry point's one call: this configuration resolved for `world_size` processes, checked by every
        rule and against the file system (--save, --load). Returns the resolved Config (this one is unchanged)."""
        from .validate import validate

        return validate(self, world_size)
