"""The rules of the parallel layout and of mixture of experts (see checks.py): the model must split evenly over
TP/PP/VPP, the world over the layout, the experts over EP/ETP."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .rule import rule

if TYPE_CHECKING:
    from .config import Config


@rule("layout")
def world_size_positive(c: Config) -> Optional[str]:
    if c.world_size < 1:
        return f"world size {c.world_size}: launch at least one process (GPUS, --nproc-per-node)"


@rule("layout")
def tp_pp_positive(c: Config) -> Optional[str]:
    if c.tensor_model_parallel_size < 1 or c.pipeline_model_parallel_size < 1:
        return "--tensor-model-parallel-size and --pipeline-model-parallel-size must be at least 1"


@rule("layout")
def heads_split_over_tp(c: Config) -> Optional[str]:
    tp = c.tensor_model_parallel_size
    if c.num_attention_heads % tp:
        return (f"--num-attention-heads {c.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}; "
                f"choose a TP size that divides the number of heads")


@rule("layout")
def query_groups(c: Config) -> Optional[str]:
    tp, groups = c.tensor_model_parallel_size, c.num_query_groups or c.num_attention_heads
    if c.num_attention_heads % groups:
        return f"--num-attention-heads {c.num_attention_heads} is not a multiple of --num-query-groups {groups}"
    if groups % tp:
        return (f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}; "
                f"lower TP or use more query groups")


@rule("layout")
def head_dimension(c: Config) -> Optional[str]:
    if c.kv_channels is None and c.hidden_size % c.num_attention_heads:
        return f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads {c.num_attention_heads}"


@rule("layout")
def padded_vocabulary_over_tp(c: Config) -> Optional[str]:
    tp = c.tensor_model_parallel_size
    if c.padded_vocab_size is not None and c.padded_vocab_size % tp:
        return (f"the checkpoint's embedding has {c.padded_vocab_size} rows (padded vocabulary), which "
                f"--tensor-model-parallel-size {tp} does not divide; choose a TP size that divides it")


@rule("layout")
def layers_over_pp(c: Config) -> Optional[str]:
    pp = c.pipeline_model_parallel_size
    if c.num_layers % pp:
        return (f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                f"each pipeline stage needs the same number of layers")


@rule("layout")
def world_over_tp_pp(c: Config) -> Optional[str]:
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    if c.world_size % (tp * pp):
        return (f"world size {c.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
                f"(GPUS=...) or change TP/PP")


@rule("layout")
def virtual_pipeline(c: Config) -> Optional[str]:
    v, pp = c.num_layers_per_virtual_pipeline_stage, c.pipeline_model_parallel_size
    if v is None:
        return None
    if pp < 2:
        return "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (interleaved 1F1B)"
    if v < 1 or c.num_layers % (pp * v):
        return (f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                f"--num-layers-per-virtual-pipeline-stage {v} = {pp * v}")
    if c.num_layers // (pp * v) < 2:
        return (f"--num-layers-per-virtual-pipeline-stage {v} gives one virtual stage per rank; lower it "
                f"so that --num-layers / (PP x it) >= 2, or drop it for plain 1F1B")


# ---- mixture of experts
@rule("moe")
def expert_flags_need_experts(c: Config) -> Optional[str]:
    if c.num_experts:
        return None
    if c.num_experts is not None:
        return f"--num-experts {c.num_experts}: give at least 1 expert, or drop the flag for a dense MLP"
    if c.expert_model_parallel_size != 1 or c.expert_tensor_parallel_size not in (None, c.tensor_model_parallel_size):
        return "--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts"
    if c.moe_shared_expert_intermediate_size is not None or c.moe_shared_expert_gate:
        return "--moe-shared-expert-intermediate-size / --moe-shared-expert-gate need --num-experts"
    if c.moe_grouped_gemm:
        return "--moe-grouped-gemm groups the GEMMs of an MoE layer's experts: it needs --num-experts"


@rule("moe")
def expert_layout(c: Config) -> Optional[str]:
    if not c.num_experts:
        return None
    ep, etp, pp, n = c.expert_model_parallel_size, c.expert_tp_size, c.pipeline_model_parallel_size, c.num_experts
    if ep < 1 or etp < 1:
        return "--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1"
    if n % ep:
        return (f"--num-experts {n} is not divisible by --expert-model-parallel-size {ep}: every EP rank holds "
                f"the same number of experts")
    if c.world_size % (etp * ep * pp):
        return (f"world size {c.world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}: the expert "
                f"layers are laid out as ETP x EP x expert-DP x PP over the same processes")


@rule("moe")
def grouped_gemm(c: Config) -> Optional[str]:
    if not (c.num_experts and c.moe_grouped_gemm):
        return None
    etp = c.expert_tp_size
    if etp > 1:
        return (f"--moe-grouped-gemm runs each expert whole on its rank; the expert tensor-parallel size is {etp} "
                f"(--expert-tensor-parallel-size, default --tensor-model-parallel-size): pass "
                f"--expert-tensor-parallel-size 1")
    if not c.disable_bias_linear:
        return ("--moe-grouped-gemm computes the experts without biases, and linear biases are on: pass "
                "--disable-bias-linear with it")
    if c.zero_2_memory_optimization:
        return ("--moe-grouped-gemm reads the experts' weights directly, which Megatron-FSDP (ZeRO-2) shards per "
                "module: use --zero-1-memory-optimization or no ZeRO with it")
    ffn = c.expert_ffn_size
    if c.hidden_size % 8 or ffn % 8:
        return (f"--moe-grouped-gemm: torch._grouped_mm needs rows of whole 16-byte units, so --hidden-size "
                f"({c.hidden_size}) and the experts' hidden size ({ffn}, --moe-ffn-hidden-size) must be multiples of 8")


@rule("moe")
def expert_width_over_etp(c: Config) -> Optional[str]:
    if not c.num_experts:
        return None
    ffn, etp = c.expert_ffn_size, c.expert_tp_size
    if ffn % etp:
        return (f"the experts' hidden size {ffn} (--moe-ffn-hidden-size) is not divisible by "
                f"--expert-tensor-parallel-size {etp}")


@rule("moe")
def router(c: Config) -> Optional[str]:
    if not c.num_experts:
        return None
    if not 1 <= c.moe_router_topk <= c.num_experts:
        return f"--moe-router-topk {c.moe_router_topk} must be between 1 and --num-experts {c.num_experts}"
    if c.moe_router_topk == 1 and not c.moe_router_pre_softmax and c.moe_router_load_balancing_type != "sinkhorn":
        return "--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over one selected expert has no gradient)"


@rule("moe")
def moe_layer_freq(c: Config) -> Optional[str]:
    freq = c.moe_layer_freq
    if not c.num_experts:
        return None
    if isinstance(freq, int) and freq < 1:
        return f"--moe-layer-freq {freq}: 1 puts experts in every layer, N in every N-th"
    if isinstance(freq, list):
        if len(freq) != c.num_layers or set(freq) - {0, 1}:
            return (f"--moe-layer-freq {freq}: a list needs one 0 (dense MLP) or 1 (experts) per layer, "
                    f"{c.num_layers} of them (--num-layers)")
        if not any(freq):
            return f"--moe-layer-freq {freq} puts experts in no layer: drop --num-experts for a dense model"


@rule("moe")
def shared_expert(c: Config) -> Optional[str]:
    if not c.num_experts:
        return None
    shared, tp = c.moe_shared_expert_intermediate_size, c.tensor_model_parallel_size
    if shared is not None and (shared < 1 or shared % tp):
        return (f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
                f"--tensor-model-parallel-size {tp} (the shared expert is sliced like a dense MLP)")
    if c.moe_shared_expert_gate and shared is None:
        return "--moe-shared-expert-gate gates the shared expert: it needs --moe-shared-expert-intermediate-size"


@rule("moe")
def expert_biases_need_whole_experts(c: Config) -> Optional[str]:
    etp = c.expert_tp_size
    if c.num_experts and not c.disable_bias_linear and etp > 1:
        return (f"--num-experts with linear biases (on unless --disable-bias-linear) needs whole experts on each rank: "
                f"megatron-core supports expert biases only at --expert-tensor-parallel-size 1 (it is {etp}, default "
                f"--tensor-model-parallel-size); pass --expert-tensor-parallel-size 1 or --disable-bias-linear")


@rule("moe")
def moe_tensor_parallel_needs_sp(c: Config) -> Optional[str]:
    if c.num_experts and c.tensor_model_parallel_size > 1 and not c.sequence_parallel:
        return ("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's MoE "
                "layer refuses to train tensor parallel without it)")


@rule("moe")
def capacity(c: Config) -> Optional[str]:
    if not c.num_experts:
        return None
    if c.moe_pad_expert_input_to_capacity and c.moe_expert_capacity_factor is None:
        return "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"
    if c.moe_expert_capacity_factor is not None and c.moe_router_load_balancing_type == "sinkhorn":
        return "--moe-expert-capacity-factor works with the aux-loss load balancing types or none, not sinkhorn"


@rule("moe")
def expert_parallel_with_zero2(c: Config) -> Optional[str]:
    if c.num_experts and c.zero_2_memory_optimization and c.expert_model_parallel_size > 1:
        return ("--zero-2-memory-optimization (Megatron-FSDP) with --expert-model-parallel-size > 1 is not supported; "
                "use --zero-1-memory-optimization (megatron-core's distributed optimizer shards expert state over "
                "expert-DP)")
