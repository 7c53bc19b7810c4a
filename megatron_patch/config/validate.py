"""Rejections of impossible settings, run before any process group starts. Each says how to fix it."""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from .errors import ConfigError
from .resume import check_resume

if TYPE_CHECKING:  # annotations only: Config.validate() calls these checks
    from .config import Config


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def check_save_dir(path: str) -> None:
    """--save must be a directory this process can create and write, before any training happens."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        _fail(f"--save {path} is not a writable directory ({e.strerror or e}); choose a directory you can write to, "
              f"or fix its permissions")


def check_load_dir(path: str) -> None:
    """--load must exist: a mistyped path must not silently train from scratch."""
    if not os.path.isdir(path):
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
        _fail(f"--load {path} {what}; give the directory that holds latest_checkpointed_iteration.txt and iter_* "
              f"(to start from scratch, create an empty directory or drop --load)")


def validate_moe(c: Config, world_size: int, tp: int, pp: int) -> int:
    """Mixture-of-experts settings; returns the expert data-parallel size (world / (ETP x EP x PP))."""
    ep, etp = c.expert_model_parallel_size, c.expert_tensor_parallel_size
    if not c.num_experts:
        if c.num_experts is not None:
            _fail(f"--num-experts {c.num_experts}: give at least 1 expert, or drop the flag for a dense MLP")
        if ep != 1 or etp not in (None, tp):
            _fail("--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts")
        if c.moe_shared_expert_intermediate_size is not None or c.moe_shared_expert_gate:
            _fail("--moe-shared-expert-intermediate-size / --moe-shared-expert-gate need --num-experts")
        if c.moe_grouped_gemm:
            _fail("--moe-grouped-gemm groups the GEMMs of an MoE layer's experts: it needs --num-experts")
        return world_size // (tp * pp)
    etp = etp or tp
    n = c.num_experts
    if ep < 1 or etp < 1:
        _fail("--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1")
    if n % ep:
        _fail(f"--num-experts {n} is not divisible by --expert-model-parallel-size {ep}: every EP rank holds "
              f"the same number of experts")
    if world_size % (etp * ep * pp):
        _fail(f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
              f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}: the expert "
              f"layers are laid out as ETP x EP x expert-DP x PP over the same processes")
    if c.moe_grouped_gemm and etp > 1:
        _fail(f"--moe-grouped-gemm runs each expert whole on its rank; the expert tensor-parallel size is {etp} "
              f"(--expert-tensor-parallel-size, default --tensor-model-parallel-size): pass "
              f"--expert-tensor-parallel-size 1")
    if c.moe_grouped_gemm and not c.disable_bias_linear:
        _fail("--moe-grouped-gemm computes the experts without biases, and linear biases are on: pass "
              "--disable-bias-linear with it")
    if c.moe_grouped_gemm and c.zero_2_memory_optimization:
        _fail("--moe-grouped-gemm reads the experts' weights directly, which Megatron-FSDP (ZeRO-2) shards per "
              "module: use --zero-1-memory-optimization or no ZeRO with it")
    ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size or 4 * c.hidden_size
    if c.moe_grouped_gemm and (c.hidden_size % 8 or ffn % 8):
        _fail(f"--moe-grouped-gemm: torch._grouped_mm needs rows of whole 16-byte units, so --hidden-size "
              f"({c.hidden_size}) and the experts' hidden size ({ffn}, --moe-ffn-hidden-size) must be multiples of 8")
    if ffn % etp:
        _fail(f"the experts' hidden size {ffn} (--moe-ffn-hidden-size) is not divisible by "
              f"--expert-tensor-parallel-size {etp}")
    if not 1 <= c.moe_router_topk <= n:
        _fail(f"--moe-router-topk {c.moe_router_topk} must be between 1 and --num-experts {n}")
    if c.moe_router_topk == 1 and not c.moe_router_pre_softmax and c.moe_router_load_balancing_type != "sinkhorn":
        _fail("--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over one selected expert has no gradient)")
    freq = c.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        _fail(f"--moe-layer-freq {freq}: 1 puts experts in every layer, N in every N-th")
    if isinstance(freq, list):
        if len(freq) != c.num_layers or set(freq) - {0, 1}:
            _fail(f"--moe-layer-freq {freq}: a list needs one 0 (dense MLP) or 1 (experts) per layer, "
                  f"{c.num_layers} of them (--num-layers)")
        if not any(freq):
            _fail(f"--moe-layer-freq {freq} puts experts in no layer: drop --num-experts for a dense model")
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % tp):
        _fail(f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
              f"--tensor-model-parallel-size {tp} (the shared expert is sliced like a dense MLP)")
    if c.moe_shared_expert_gate and shared is None:
        _fail("--moe-shared-expert-gate gates the shared expert: it needs --moe-shared-expert-intermediate-size")
    if not c.disable_bias_linear and etp > 1:
        _fail(f"--num-experts with linear biases (on unless --disable-bias-linear) needs whole experts on each rank: "
              f"megatron-core supports expert biases only at --expert-tensor-parallel-size 1 (it is {etp}, default "
              f"--tensor-model-parallel-size); pass --expert-tensor-parallel-size 1 or --disable-bias-linear")
    if tp > 1 and not c.sequence_parallel:
        _fail("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's MoE "
              "layer refuses to train tensor parallel without it)")
    if c.moe_pad_expert_input_to_capacity and c.moe_expert_capacity_factor is None:
        _fail("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if c.moe_expert_capacity_factor is not None and c.moe_router_load_balancing_type == "sinkhorn":
        _fail("--moe-expert-capacity-factor works with the aux-loss load balancing types or none, not sinkhorn")
    if c.zero_2_memory_optimization and ep > 1:
        _fail("--zero-2-memory-optimization (Megatron-FSDP) with --expert-model-parallel-size > 1 is not supported; "
              "use --zero-1-memory-optimization (megatron-core's distributed optimizer shards expert state over "
              "expert-DP)")
    return world_size // (etp * ep * pp)


CROSS_ENTROPY_FUSION_IMPLS = ("native", "te", "linear", "triton")


def validate_loss_fusion(c: Config) -> None:
    """--cross-entropy-loss-fusion / --cross-entropy-fusion-impl (Megatron-LM's names and values)."""
    impl = c.cross_entropy_fusion_impl
    if impl not in CROSS_ENTROPY_FUSION_IMPLS:
        _fail(f"--cross-entropy-fusion-impl {impl!r}: choose native, te, linear or triton (one of them)")
    if not c.cross_entropy_loss_fusion:
        if impl != "native":
            _fail(f"--cross-entropy-fusion-impl {impl} takes effect only with --cross-entropy-loss-fusion: add it "
                  f"(or drop --cross-entropy-fusion-impl)")
        return
    if c.model_family == "bert":
        _fail("--cross-entropy-loss-fusion is for GPT/Llama-family models: BERT's masked-LM head (dense, norm, output "
              "layer with a bias) keeps megatron-core's loss; drop the flag")
    if impl == "native" and not c.bf16:
        _fail(f"--cross-entropy-loss-fusion with --cross-entropy-fusion-impl native (the default): megatron-core's fused "
              f"cross entropy returns the gradient of the logits in bf16, which would round this {c.params_dtype_name} "
              f"run's gradients; use it with --bf16, or use --cross-entropy-fusion-impl linear")
    if impl == "te" and importlib.util.find_spec("transformer_engine") is None:
        _fail("--cross-entropy-fusion-impl te needs Transformer Engine, which is not installed: use linear (fused "
              "output layer and loss) or native")
    if impl == "triton":
        _need_triton("--cross-entropy-fusion-impl triton", missing="use linear or native",
                     no_gpu="use --cross-entropy-fusion-impl linear")


def _validate_optimizer_step_fusion(c: Config) -> None:
    if not c.bf16:
        _fail("--optimizer-step-fusion fuses the bf16 optimizer's step (fp32 main weights behind bf16 ones): add --bf16")
    for flag, on in (("--zero-1-memory-optimization", c.zero_1_memory_optimization),
                     ("--zero-2-memory-optimization", c.zero_2_memory_optimization), ("--cpu-offload", c.cpu_offload),
                     ("--optimizers apex_lamb", c.optimizers == "apex_lamb")):
        if on:
            _fail(f"--optimizer-step-fusion runs Adam on unsharded GPU state; {flag} steps another way: drop one of them")
    _need_triton("--optimizer-step-fusion", missing="drop the flag", no_gpu="drop the flag")


def _need_triton(flag: str, missing: str, no_gpu: str) -> None:
    """Fail unless Triton kernels can run: the package, and a GPU or Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        _fail(f"{flag} needs the triton package (it comes with torch's CUDA wheels), which is not installed: install "
              f"it, or {missing}")
    if not _has_gpu() and not _triton_interpret():
        _fail(f"{flag} runs Triton kernels, which need a CUDA GPU; this machine has none. On the CPU set "
              f"TRITON_INTERPRET=1 in the environment (Triton's interpreter: correct but slow, for tests), or {no_gpu}")


def _triton_interpret() -> bool:
    """TRITON_INTERPRET as Triton itself reads it (1, true, on, yes, ...)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


BERT_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")


def validate_bert_pretraining(c: Config) -> None:
    """Settings of BERT pretraining (pretrain_megatron_bert.py), after `validate`: its data and objective. (The
    model's own limits are checked where it is built, models/bert.py: check_bert_config; a BERT used elsewhere,
    e.g. converted from Hugging Face, needs none of these.)"""
    if c.mock_data:
        _fail("BERT pretraining has no --mock-data (megatron-core has no mock BERT dataset): pass --data-path "
              "PREFIX_text_sentence made by tools/preprocess_data.py --split-sentences with a WordPiece tokenizer")
    if c.tokenizer_type not in BERT_TOKENIZERS:
        _fail(f"--tokenizer-type {c.tokenizer_type}: BERT pretraining masks with [MASK] and joins sentences with [CLS] "
              f"and [SEP]; use {' or '.join(BERT_TOKENIZERS)} with --vocab-file vocab.txt")
    if not 0 < c.mask_prob < 1:
        _fail(f"--mask-prob {c.mask_prob} must be between 0 and 1 (Megatron-LM and BERT use 0.15)")
    if not 0 <= c.short_seq_prob <= 1:
        _fail(f"--short-seq-prob {c.short_seq_prob} must be between 0 and 1 (default 0.1)")
    if c.num_experts:
        _fail("--num-experts: the BERT layers have dense MLPs only; mixture of experts is for GPT-family models")
    if c.seq_length < 8:
        _fail(f"--seq-length {c.seq_length} is too short for BERT samples ([CLS] A [SEP] B [SEP] and masked tokens)")
    if c.num_layers_per_virtual_pipeline_stage is not None:
        _fail("--num-layers-per-virtual-pipeline-stage: megatron-core's BertModel decides where the embedding is by "
              "the pipeline rank, not the virtual stage; use plain pipeline parallelism for BERT")


def validate(c: Config, world_size: int) -> None:
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    if world_size < 1:
        _fail(f"world size {world_size}: launch at least one process (GPUS, --nproc-per-node)")
    if tp < 1 or pp < 1:
        _fail("--tensor-model-parallel-size and --pipeline-model-parallel-size must be at least 1")
    if c.num_attention_heads % tp:
        _fail(f"--num-attention-heads {c.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}; "
              f"choose a TP size that divides the number of heads")
    groups = c.num_query_groups or c.num_attention_heads
    if c.num_attention_heads % groups:
        _fail(f"--num-attention-heads {c.num_attention_heads} is not a multiple of --num-query-groups {groups}")
    if groups % tp:
        _fail(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}; "
              f"lower TP or use more query groups")
    if c.kv_channels is None and c.hidden_size % c.num_attention_heads:
        _fail(f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads {c.num_attention_heads}")
    if c.padded_vocab_size is not None and c.padded_vocab_size % tp:
        _fail(f"the checkpoint's embedding has {c.padded_vocab_size} rows (padded vocabulary), which "
              f"--tensor-model-parallel-size {tp} does not divide; choose a TP size that divides it")
    if c.num_layers % pp:
        _fail(f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
              f"each pipeline stage needs the same number of layers")
    if world_size % (tp * pp):
        _fail(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
              f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
              f"(GPUS=...) or change TP/PP")
    dp = world_size // (tp * pp)
    if c.num_layers_per_virtual_pipeline_stage is not None:
        v = c.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (interleaved 1F1B)")
        if v < 1 or c.num_layers % (pp * v):
            _fail(f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                  f"--num-layers-per-virtual-pipeline-stage {v} = {pp * v}")
        if c.num_layers // (pp * v) < 2:
            _fail(f"--num-layers-per-virtual-pipeline-stage {v} gives one virtual stage per rank; lower it "
                  f"so that --num-layers / (PP x it) >= 2, or drop it for plain 1F1B")
    c.expert_data_parallel_size = validate_moe(c, world_size, tp, pp)
    if c.global_batch_size is None:
        c.global_batch_size = c.micro_batch_size * dp
    if c.micro_batch_size < 1 or c.global_batch_size % (c.micro_batch_size * dp):
        _fail(f"--global-batch-size {c.global_batch_size} is not divisible by --micro-batch-size "
              f"{c.micro_batch_size} x data-parallel size {dp} = {c.micro_batch_size * dp}; gradient accumulation "
              f"needs a whole number of micro batches per rank")
    if c.num_layers_per_virtual_pipeline_stage is not None and (c.global_batch_size // (c.micro_batch_size * dp)) % pp:
        _fail(f"interleaved pipelining needs the number of micro batches ({c.global_batch_size // (c.micro_batch_size * dp)}) "
              f"to be a multiple of --pipeline-model-parallel-size {pp}; raise --global-batch-size")
    zero = [n for n, on in ((1, c.zero_1_memory_optimization), (2, c.zero_2_memory_optimization),
                            (3, c.zero_3_memory_optimization)) if on]
    if len(zero) > 1:
        _fail(f"choose one ZeRO stage, not {' and '.join(f'--zero-{z}-memory-optimization' for z in zero)}")
    if c.zero_3_memory_optimization and (tp > 1 or pp > 1):
        _fail("--zero-3-memory-optimization cannot be combined with tensor or pipeline parallelism (the "
              "documentation allows only ZeRO-1/2 with 3D parallelism); use --zero-2-memory-optimization or TP=PP=1")
    if c.zero_3_memory_optimization:
        _fail("--zero-3-memory-optimization is for Hugging Face models through the rapidformer front end; "
              "the Megatron engine supports --zero-1-memory-optimization and --zero-2-memory-optimization")
    if c.zero_2_memory_optimization and c.num_layers_per_virtual_pipeline_stage is not None:
        _fail("--zero-2-memory-optimization (Megatron-FSDP) is not supported with virtual pipeline stages; "
              "drop --num-layers-per-virtual-pipeline-stage or use --zero-1-memory-optimization")
    if c.zero_2_memory_optimization and c.fp16:
        _fail("--zero-2-memory-optimization runs bf16 or fp32; fp16 loss scaling is not supported there: use --bf16")
    if c.sequence_parallel and tp < 2:
        _fail("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations across TP ranks)")
    if c.mixed_precision:
        # Rapidformer's --mixed-precision is FP16 training; bf16 is the explicit --bf16.
        if c.bf16:
            _fail("--mixed-precision means fp16 and cannot be combined with --bf16; pass only one of them")
        c.fp16 = True
    if c.fp16 and c.bf16:
        _fail("--fp16 and --bf16 are mutually exclusive; pass only one")
    if c.grad_reduce_in_bf16 and not c.bf16:
        _fail("--grad-reduce-in-bf16 applies to bf16 training: add --bf16 (fp32 and fp16 runs keep fp32 gradients)")
    if c.grad_reduce_in_bf16 and c.zero_2_memory_optimization:
        _fail("--grad-reduce-in-bf16 is for plain data parallelism and --zero-1-memory-optimization; ZeRO-2 "
              "(Megatron-FSDP) keeps its sharded gradients in fp32: drop one of the two")
    if c.gradient_accumulation_fusion and c.zero_2_memory_optimization:
        _fail("--gradient-accumulation-fusion accumulates into the DDP / ZeRO-1 gradient buffer; ZeRO-2 "
              "(Megatron-FSDP) shards its gradients itself: drop one of the two")
    if c.optimizer_step_fusion:
        _validate_optimizer_step_fusion(c)
    if c.checkpoint_activations and c.recompute_granularity is None:
        c.recompute_granularity = "full"
    if c.recompute_granularity not in (None, "full", "selective"):
        _fail(f"--recompute-granularity {c.recompute_granularity!r}: choose full or selective")
    if c.optimizers not in ("apex_adam", "apex_lamb"):
        _fail(f"--optimizers {c.optimizers!r}: choose apex_adam or apex_lamb")
    if c.optimizers == "apex_lamb" and (c.zero_1_memory_optimization or c.zero_2_memory_optimization):
        _fail("--optimizers apex_lamb needs whole parameters for its trust ratio, but "
              "--zero-1-memory-optimization shards them across ranks; use apex_adam with ZeRO, or LAMB without it")
    if c.cpu_offload and not _has_gpu():  # before the ZeRO rule: no ZeRO flag makes it useful here
        _fail("--cpu-offload moves the optimizer state from GPU memory to host memory; this machine has no GPU, "
              "so everything already lives on the CPU: drop --cpu-offload")
    if c.cpu_offload and not (c.zero_1_memory_optimization or c.zero_2_memory_optimization):
        _fail("--cpu-offload keeps the sharded optimizer state on the CPU and needs ZeRO: add "
              "--zero-1-memory-optimization (the documentation requires ZeRO with CPU offload)")
    validate_loss_fusion(c)
    if c.compile_mode != "default" and not c.compile:
        _fail(f"--compile-mode {c.compile_mode} takes effect only with --compile: add it (or drop --compile-mode)")
    if c.data_iterator == "dynamic-shape":
        _fail("--data-iterator dynamic-shape applies to document-level samples (the Rapidformer Pretrainer/"
              "Finetuner templates); GPT pretraining samples are packed to --seq-length and carry no padding")
    if c.lr_decay_style not in ("constant", "linear", "cosine"):
        _fail(f"--lr-decay-style {c.lr_decay_style!r}: choose constant, linear or cosine")
    if c.lr_warmup_fraction is not None and c.lr_warmup_iters:
        _fail("pass --lr-warmup-fraction or --lr-warmup-iters, not both")
    if c.train_iters < 1:
        _fail("--train-iters must be at least 1")
    if c.profile and not 0 <= c.profile_step_start < c.profile_step_end <= c.train_iters:
        _fail(f"--profile over iterations ({c.profile_step_start}, {c.profile_step_end}] needs 0 <= "
              f"--profile-step-start < --profile-step-end <= --train-iters ({c.train_iters})")
    decay, warmup = c.decay_iters, c.warmup_iters
    if c.lr_warmup_fraction is not None and not 0 <= c.lr_warmup_fraction < 1:
        _fail(f"--lr-warmup-fraction {c.lr_warmup_fraction} must be in [0, 1): the share of --lr-decay-iters "
              f"(else --train-iters) spent warming up")
    if warmup >= decay:
        _fail(f"learning-rate warmup ({warmup} iterations) must end before decay does ({decay} iterations: "
              f"--lr-decay-iters or --train-iters); lower --lr-warmup-iters/--lr-warmup-fraction")
    if c.position_embedding_type not in ("learned_absolute", "rope"):
        _fail(f"--position-embedding-type {c.position_embedding_type!r}: choose learned_absolute or rope")
    if c.normalization not in ("LayerNorm", "RMSNorm"):
        _fail(f"--normalization {c.normalization!r}: choose LayerNorm or RMSNorm")
    if c.max_position_embeddings is None:
        c.max_position_embeddings = c.seq_length
    if c.position_embedding_type == "learned_absolute" and c.seq_length > c.max_position_embeddings:
        _fail(f"--seq-length {c.seq_length} exceeds --max-position-embeddings {c.max_position_embeddings}")
    if not c.data_path and not c.mock_data:
        _fail("no training data: pass --data-path PREFIX (made by tools/preprocess_data.py) or --mock-data")
    if c.data_path and c.tokenizer_type is None:
        _fail("--data-path needs --tokenizer-type (and its --vocab-file/--merge-file/--tokenizer-model)")
    if c.mock_data and not c.data_path and c.vocab_size is None:
        c.vocab_size = 1024
    if c.keep_last_n is not None and c.keep_last_n < 1:
        _fail(f"--keep-last-n {c.keep_last_n}: keep at least 1 checkpoint (the newest is never deleted)")
    if c.save_interval is not None and not c.save:
        _fail("--save-interval needs --save DIR")
    if c.save:
        check_save_dir(c.save)
    if c.load:
        check_load_dir(c.load)
    c.world_size = world_size
    c.data_parallel_size = dp
    c.num_microbatches = c.global_batch_size // (c.micro_batch_size * dp)
    # Last: these compare the final settings (layout, global batch) with the checkpoints in --load and --save.
    check_resume(c)
