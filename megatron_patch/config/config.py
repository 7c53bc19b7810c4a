"""The `Config` dataclass: every pretraining setting, with Megatron-LM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from .errors import ConfigError  # noqa: F401  (re-exported: `from megatron_patch.config.config import ConfigError`)


@dataclass
class Config:
    # ---- model
    model_family: Optional[str] = None
    model_size: Optional[str] = None
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
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
    # ---- mixture of experts (megatron-core MoELayer; None = dense MLP)
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
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_per_layer_logging: bool = False
    moe_grouped_gemm: bool = False  # experts as two torch._grouped_mm calls (models/grouped_experts.py)
    # ---- BERT pretraining (pretrain_megatron_bert.py; Megatron-LM's names and defaults; bert_binary_head above)
    mask_prob: float = 0.15  # share of tokens the masked-LM objective predicts
    short_seq_prob: float = 0.1  # share of samples cut shorter than --seq-length

    # ---- data
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
    num_workers: int = 0

    # ---- training
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    train_iters: int = 100
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
    optimizers: str = "apex_adam"
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 10
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    exit_on_nan: bool = True
    metrics_file: Optional[str] = None
    exit_interval: Optional[int] = None
    skip_train: bool = False
    no_load_optim: bool = False
    # A resume whose lr schedule flags differ from the checkpoint's is refused unless one of these says which wins
    # (Megatron-LM's flags): this run's settings, continued from the checkpoint's step, or the checkpoint's.
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    keep_last_n: Optional[int] = None
    compile: bool = False
    compile_mode: str = "default"  # torch.compile mode of --compile; reduce-overhead: CUDA graphs per layer
    profile: bool = False  # torch.profiler over iterations (profile_step_start, profile_step_end], with a GPU-time breakdown
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_dir: str = "profile"
    load_hf: Optional[str] = None  # a Hugging Face model directory: architecture and weights come from it
    validate_only: bool = False  # check config and data for WORLD_SIZE processes, then exit

    # ---- parallelism and switches
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # default --tensor-model-parallel-size
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    sequence_parallel: bool = False
    zero_1_memory_optimization: bool = False
    zero_2_memory_optimization: bool = False
    zero_3_memory_optimization: bool = False
    bf16: bool = False
    fp16: bool = False
    mixed_precision: bool = False
    grad_reduce_in_bf16: bool = False  # bf16 gradient buffer (accumulation and DP reduction) instead of fp32
    gradient_accumulation_fusion: bool = False  # weight gradients accumulated straight into the gradient buffer
    optimizer_step_fusion: bool = False  # bf16 Adam step, one Triton launch per param group (training/fused_adam.py)
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    checkpoint_activations: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    cpu_offload: bool = False
    # Megatron-LM's switches of a fused loss: native/te fuse the softmax cross entropy of the logits (megatron-core's
    # own implementations), linear also the output layer, so the full logits never exist (models/linear_cross_entropy.py),
    # triton: our Triton kernels over the logits (models/triton_cross_entropy.py)
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"  # native | te | linear | triton

    # ---- derived by validate()
    world_size: int = 1
    data_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    num_microbatches: int = 1

    @property
    def virtual_pipeline_model_parallel_size(self) -> Optional[int]:
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        return self.num_layers // (self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage)

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

    @property
    def params_dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def validate(self, world_size: int) -> "Config":
        """Check the whole configuration for `world_size` processes and fill the derived fields."""
        from .validate import validate

        validate(self, world_size)
        return self
