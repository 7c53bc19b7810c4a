"""The rules of batching, memory savers, precision, fused kernels, the schedule, the model's options, data and
checkpoint flags (see checks.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from . import rule as probes  # the GPU / Triton probes (tests replace _has_gpu)
from .rule import rule

if TYPE_CHECKING:
    from .config import Config

CROSS_ENTROPY_FUSION_IMPLS = ("native", "te", "linear", "triton")


@rule("batch")
def global_batch(c: Config) -> Optional[str]:
    dp, mbs, gbs = c.data_parallel_size, c.micro_batch_size, c.global_batch_size
    if mbs < 1 or gbs % (mbs * dp):
        return (f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp} = "
                f"{mbs * dp}; gradient accumulation needs a whole number of micro batches per rank")


@rule("batch")
def interleaved_micro_batches(c: Config) -> Optional[str]:
    pp = c.pipeline_model_parallel_size
    if c.num_layers_per_virtual_pipeline_stage is not None and c.num_microbatches % pp:
        return (f"interleaved pipelining needs the number of micro batches ({c.num_microbatches}) "
                f"to be a multiple of --pipeline-model-parallel-size {pp}; raise --global-batch-size")


@rule("memory")
def zero_stage(c: Config) -> Optional[str]:
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    if c.zero_stage not in (0, 1, 2, 3):
        return f"ZeRO stage {c.zero_stage}: choose 0, 1, 2 or 3"
    if c.zero_stage == 3 and (tp > 1 or pp > 1):
        return ("--zero-3-memory-optimization cannot be combined with tensor or pipeline parallelism (the "
                "documentation allows only ZeRO-1/2 with 3D parallelism); use --zero-2-memory-optimization or TP=PP=1")
    if c.zero_stage == 3:
        return ("--zero-3-memory-optimization is for Hugging Face models through the rapidformer front end; "
                "the Megatron engine supports --zero-1-memory-optimization and --zero-2-memory-optimization")
    if c.zero_stage == 2 and c.num_layers_per_virtual_pipeline_stage is not None:
        return ("--zero-2-memory-optimization (Megatron-FSDP) is not supported with virtual pipeline stages; "
                "drop --num-layers-per-virtual-pipeline-stage or use --zero-1-memory-optimization")
    if c.zero_stage == 2 and c.fp16:
        return "--zero-2-memory-optimization runs bf16 or fp32; fp16 loss scaling is not supported there: use --bf16"


@rule("memory")
def sequence_parallel_needs_tp(c: Config) -> Optional[str]:
    if c.sequence_parallel and c.tensor_model_parallel_size < 2:
        return "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations across TP ranks)"


@rule("precision")
def grad_reduce_in_bf16(c: Config) -> Optional[str]:
    if c.grad_reduce_in_bf16 and not c.bf16:
        return "--grad-reduce-in-bf16 applies to bf16 training: add --bf16 (fp32 and fp16 runs keep fp32 gradients)"
    if c.grad_reduce_in_bf16 and c.zero_2_memory_optimization:
        return ("--grad-reduce-in-bf16 is for plain data parallelism and --zero-1-memory-optimization; ZeRO-2 "
                "(Megatron-FSDP) keeps its sharded gradients in fp32: drop one of the two")


@rule("precision")
def fp8(c: Config) -> Optional[str]:
    if c.fp8_format is None:
        if c.fp8_recipe != "tensorwise" or c.fp8_layers != "auto":
            return "--fp8-recipe and --fp8-layers choose how FP8 runs: add --fp8-format (hybrid or e4m3) to turn it on"
        return None
    if c.fp16:
        return "--fp8-format runs its GEMMs from bf16 (or fp32) tensors, not fp16 ones: use --bf16"
    te = probes.transformer_engine_available() and probes.resolved_attention_backend(c.attention_backend) == "te"
    if c.fp8_recipe in ("delayed", "mxfp8", "blockwise") and not te:
        return (f"--fp8-recipe {c.fp8_recipe} needs Transformer Engine, which is not installed; without it FP8 runs "
                f"through torchao: --fp8-recipe tensorwise (--fp8-format hybrid) or rowwise (--fp8-format e4m3)")
    if te:
        return None
    want = {"tensorwise": "hybrid", "rowwise": "e4m3"}[c.fp8_recipe]
    if c.fp8_format != want:
        other = "rowwise" if c.fp8_recipe == "tensorwise" else "tensorwise"
        return (f"torchao's {c.fp8_recipe} recipe is --fp8-format {want} (tensorwise: e4m3 forward, e5m2 gradients; "
                f"rowwise: e4m3 throughout): pass --fp8-format {want}, or --fp8-recipe {other} for "
                f"--fp8-format {c.fp8_format}")
    if c.lora_rank:
        return "--fp8-format with --lora-rank is not supported (LoRA's layers have their own linear function): drop one"
    if c.zero_2_memory_optimization:
        return ("--fp8-format's linears are not supported with --zero-2-memory-optimization (Megatron-FSDP); use "
                "--zero-1-memory-optimization")
    return None


@rule("fusion")
def gradient_accumulation_fusion(c: Config) -> Optional[str]:
    if c.gradient_accumulation_fusion and c.zero_2_memory_optimization:
        return ("--gradient-accumulation-fusion accumulates into the DDP / ZeRO-1 gradient buffer; ZeRO-2 "
                "(Megatron-FSDP) shards its gradients itself: drop one of the two")


@rule("fusion")
def moment_dtypes(c: Config) -> Optional[str]:
    lower = [f"--{k.replace('_', '-')} {getattr(c, k)}" for k in ("exp_avg_dtype", "exp_avg_sq_dtype")
             if getattr(c, k) != "fp32"]
    if lower and not c.optimizer_step_fusion:
        return (f"{' and '.join(lower)} keeps Adam's moments in bf16 through the fused Adam kernel: add "
                f"--optimizer-step-fusion (megatron-core's precision-aware optimizer needs Transformer Engine)")


@rule("fusion")
def optimizer_step_fusion(c: Config) -> Optional[str]:
    if not c.optimizer_step_fusion:
        return None
    if not c.bf16:
        return "--optimizer-step-fusion fuses the bf16 optimizer's step (fp32 main weights behind bf16 ones): add --bf16"
    for flag, on in (("--zero-1-memory-optimization", c.zero_1_memory_optimization),
                     ("--zero-2-memory-optimization", c.zero_2_memory_optimization), ("--cpu-offload", c.cpu_offload),
                     ("--optimizers apex_lamb", c.optimizers == "apex_lamb")):
        if on:
            return f"--optimizer-step-fusion runs Adam on unsharded GPU state; {flag} steps another way: drop one of them"
    return probes.triton_missing("--optimizer-step-fusion", missing="drop the flag", no_gpu="drop the flag")


@rule("memory")
def recompute_granularity(c: Config) -> Optional[str]:
    if c.recompute_granularity not in (None, "full", "selective"):
        return f"--recompute-granularity {c.recompute_granularity!r}: choose full or selective"


@rule("optimizer")
def optimizer_choice(c: Config) -> Optional[str]:
    if c.optimizers not in ("apex_adam", "apex_lamb"):
        return f"--optimizers {c.optimizers!r}: choose apex_adam or apex_lamb"
    if c.optimizers == "apex_lamb" and c.zero_stage in (1, 2):
        return ("--optimizers apex_lamb needs whole parameters for its trust ratio, but "
                "--zero-1-memory-optimization shards them across ranks; use apex_adam with ZeRO, or LAMB without it")


@rule("memory")
def cpu_offload(c: Config) -> Optional[str]:
    if not c.cpu_offload:
        return None
    if not probes._has_gpu():  # before the ZeRO rule: no ZeRO flag makes it useful here
        return ("--cpu-offload moves the optimizer state from GPU memory to host memory; this machine has no GPU, "
                "so everything already lives on the CPU: drop --cpu-offload")
    if c.zero_stage not in (1, 2):
        return ("--cpu-offload keeps the sharded optimizer state on the CPU and needs ZeRO: add "
                "--zero-1-memory-optimization (the documentation requires ZeRO with CPU offload)")


@rule("fusion")
def loss_fusion(c: Config) -> Optional[str]:
    """--cross-entropy-loss-fusion / --cross-entropy-fusion-impl (Megatron-LM's names and values)."""
    impl = c.cross_entropy_fusion_impl
    if impl not in CROSS_ENTROPY_FUSION_IMPLS:
        return f"--cross-entropy-fusion-impl {impl!r}: choose native, te, linear or triton (one of them)"
    if not c.cross_entropy_loss_fusion:
        if impl != "native":
            return (f"--cross-entropy-fusion-impl {impl} takes effect only with --cross-entropy-loss-fusion: add it "
                    f"(or drop --cross-entropy-fusion-impl)")
        return None
    if c.model_family == "bert":
        return ("--cross-entropy-loss-fusion is for GPT/Llama-family models: BERT's masked-LM head (dense, norm, output "
                "layer with a bias) keeps megatron-core's loss; drop the flag")
    if impl == "native" and not c.bf16:
        return (f"--cross-entropy-loss-fusion with --cross-entropy-fusion-impl native (the default): megatron-core's "
                f"fused cross entropy returns the gradient of the logits in bf16, which would round this "
                f"{c.params_dtype_name} run's gradients; use it with --bf16, or use --cross-entropy-fusion-impl linear")
    if impl == "te" and not probes.transformer_engine_available():
        return ("--cross-entropy-fusion-impl te needs Transformer Engine, which is not installed: use linear (fused "
                "output layer and loss) or native")
    if impl == "triton":
        return probes.triton_missing("--cross-entropy-fusion-impl triton", missing="use linear or native",
                                     no_gpu="use --cross-entropy-fusion-impl linear")


@rule("fusion")
def compile_mode(c: Config) -> Optional[str]:
    if c.compile_mode != "default" and not c.compile:
        return f"--compile-mode {c.compile_mode} takes effect only with --compile: add it (or drop --compile-mode)"


@rule("data")
def fixed_shape_samples(c: Config) -> Optional[str]:
    if c.data_iterator == "dynamic-shape":
        return ("--data-iterator dynamic-shape applies to document-level samples (the Rapidformer Pretrainer/"
                "Finetuner templates); GPT pretraining samples are packed to --seq-length and carry no padding")


@rule("schedule")
def schedule(c: Config) -> Optional[str]:
    if c.lr_decay_style not in ("constant", "linear", "cosine"):
        return f"--lr-decay-style {c.lr_decay_style!r}: choose constant, linear or cosine"
    if c.lr_warmup_fraction is not None and c.lr_warmup_iters:
        return "pass --lr-warmup-fraction or --lr-warmup-iters, not both"
    if c.train_iters < 1:
        return "--train-iters must be at least 1"


@rule("logging")
def profile_window(c: Config) -> Optional[str]:
    if c.profile and not 0 <= c.profile_step_start < c.profile_step_end <= c.train_iters:
        return (f"--profile over iterations ({c.profile_step_start}, {c.profile_step_end}] needs 0 <= "
                f"--profile-step-start < --profile-step-end <= --train-iters ({c.train_iters})")


@rule("schedule")
def warmup(c: Config) -> Optional[str]:
    if c.lr_warmup_fraction is not None and not 0 <= c.lr_warmup_fraction < 1:
        return (f"--lr-warmup-fraction {c.lr_warmup_fraction} must be in [0, 1): the share of --lr-decay-iters "
                f"(else --train-iters) spent warming up")
    if c.warmup_iters >= c.decay_iters:
        return (f"learning-rate warmup ({c.warmup_iters} iterations) must end before decay does ({c.decay_iters} "
                f"iterations: --lr-decay-iters or --train-iters); lower --lr-warmup-iters/--lr-warmup-fraction")


@rule("model")
def model_choices(c: Config) -> Optional[str]:
    if c.position_embedding_type not in ("learned_absolute", "rope"):
        return f"--position-embedding-type {c.position_embedding_type!r}: choose learned_absolute or rope"
    if c.normalization not in ("LayerNorm", "RMSNorm"):
        return f"--normalization {c.normalization!r}: choose LayerNorm or RMSNorm"


@rule("model")
def positions(c: Config) -> Optional[str]:
    if c.position_embedding_type == "learned_absolute" and c.seq_length > c.max_position_embeddings:
        return f"--seq-length {c.seq_length} exceeds --max-position-embeddings {c.max_position_embeddings}"


@rule("data")
def training_data(c: Config) -> Optional[str]:
    if not c.data_path and not c.mock_data:
        return "no training data: pass --data-path PREFIX (made by tools/preprocess_data.py) or --mock-data"
    if c.data_path and c.tokenizer_type is None:
        return "--data-path needs --tokenizer-type (and its --vocab-file/--merge-file/--tokenizer-model)"


@rule("data")
def sft_data(c: Config) -> Optional[str]:
    if not c.sft:
        if not c.pack_sequences:
            return "--no-pack-sequences applies to --sft data (pretraining samples are always --seq-length tokens)"
        return None
    if c.mock_data:
        return "--sft trains on chat data from tools/preprocess_data.py --sft: pass --data-path PREFIX_text_document, not --mock-data"
    if len(c.data_path) != 1:
        return (f"--sft takes one --data-path prefix (got {len(c.data_path)} values); put the conversations in one "
                f"preprocess_data.py --sft run (its --input takes a directory or a glob)")
    if not c.data_path[0].endswith("_text_document"):
        return (f"--sft --data-path {c.data_path[0]}: give the PREFIX_text_document that preprocess_data.py --sft "
                f"wrote (its PREFIX_loss_mask_document is found next to it)")
    if c.pack_sequences and c.multi_latent_attention:
        return "--sft packed sequences are not supported with multi-latent attention yet; use --no-pack-sequences"
    if c.pack_sequences and c.position_embedding_type != "rope":
        return ("--sft packed sequences restart positions per conversation through RoPE; a learned_absolute model "
                "needs --no-pack-sequences")
    if c.zero_stage == 2:
        return "--sft with --zero-2-memory-optimization (Megatron-FSDP) is not supported yet: use --zero-1-memory-optimization"


@rule("model")
def lora(c: Config) -> Optional[str]:
    if not c.lora_rank:
        return None
    if c.lora_rank < 0:
        return f"--lora-rank {c.lora_rank}: give a positive rank (0 turns LoRA off)"
    if not 0 <= c.lora_dropout < 1:
        return f"--lora-dropout {c.lora_dropout}: give a probability in [0, 1)"
    from .lora_targets import resolve_targets

    try:
        resolve_targets(c.lora_target, c.swiglu)
    except ValueError as e:
        return str(e)
    if c.zero_stage == 2:
        return "--lora-rank with --zero-2-memory-optimization (Megatron-FSDP) is not supported: use --zero-1-memory-optimization"
    if c.multi_latent_attention:
        return "--lora-rank on multi-latent attention is not supported yet (its projections are not linear_qkv/linear_proj)"


@rule("checkpoint")
def checkpoint_flags(c: Config) -> Optional[str]:
    if c.keep_last_n is not None and c.keep_last_n < 1:
        return f"--keep-last-n {c.keep_last_n}: keep at least 1 checkpoint (the newest is never deleted)"
    if c.save_interval is not None and not c.save:
        return "--save-interval needs --save DIR"


@rule("schedule")
def hang_timeouts(c: Config) -> Optional[str]:
    for flag, value in (("--distributed-timeout-minutes", c.distributed_timeout_minutes),
                        ("--heartbeat-timeout-seconds", c.heartbeat_timeout_seconds),
                        ("--step-timeout-minutes", c.step_timeout_minutes)):
        if value is not None and not value > 0:
            return f"{flag} {value:g}: give a positive time"
    if c.heartbeat_timeout_seconds >= c.distributed_timeout_minutes * 60:
        return (f"--heartbeat-timeout-seconds {c.heartbeat_timeout_seconds:g} is not shorter than "
                f"--distributed-timeout-minutes {c.distributed_timeout_minutes:g}: a stopped worker would end the job "
                "through the collectives' timeout, unnamed; lower the heartbeat timeout or raise the other")


@rule("checkpoint")
def async_save(c: Config) -> Optional[str]:
    if c.async_save and c.zero_2_memory_optimization:
        return ("--async-save writes megatron-core torch_dist checkpoints (ZeRO-0/1); a ZeRO-2 run saves Megatron-FSDP's "
                "DTensors synchronously: drop --async-save or use --zero-1-memory-optimization")


@rule("checkpoint")
def fully_reshardable_optimizer(c: Config) -> Optional[str]:
    if c.dist_ckpt_optim_fully_reshardable and c.zero_stage != 1:
        return ("--dist-ckpt-optim-fully-reshardable is the format of the distributed optimizer's state "
                "(--zero-1-memory-optimization); without ZeRO the optimizer state follows the model at any layout "
                "already, ZeRO-2 saves Megatron-FSDP's DTensors: drop it or add --zero-1-memory-optimization")
