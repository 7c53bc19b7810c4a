"""training.profiling: kernel names fall in the right category and idle time is the span not covered by kernels."""
from __future__ import annotations

import pytest

from megatron_patch.training.profiling import breakdown, categorize, top_kernels


@pytest.mark.parametrize("name,category", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "loss"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("triton_per_fused_native_layer_norm_0", "other (norms, elementwise)"),
])
def test_kernel_names_are_categorized(name, category):
    assert categorize(name) == category


def test_idle_is_the_span_minus_the_union_of_kernels():
    kernels = [("gemm_a", 0.0, 2.0), ("gemm_b", 1.0, 3.0),  # overlapping: busy 0..3
               ("triton_x", 5.0, 6.0)]                      # gap 3..5
    got = breakdown(kernels)
    assert got["matmul"] == pytest.approx(4.0) and got["other (norms, elementwise)"] == pytest.approx(1.0)
    assert got["idle"] == pytest.approx(2.0)
    assert top_kernels(kernels)["matmul"][0] == ("gemm_b", pytest.approx(2.0)) or \
        top_kernels(kernels)["matmul"][0][1] == pytest.approx(2.0)


def test_lambda_in_a_kernel_name_is_not_an_optimizer():
    assert categorize("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<"
                      "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>") != "optimizer"
