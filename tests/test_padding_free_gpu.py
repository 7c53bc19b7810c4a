"""`--padding-free` on a GPU: the flash kernels on packed sequences (compat/flash_varlen.py) and the CUDA-graph loop.

- the varlen op against SDPA run on each segment alone (bf16): outputs and the three input gradients, with an empty
  segment and a length bound (`max_len`) above the longest segment, as the packed rows have;
- attention dropout: one segment through the varlen op and through SDPA's flash kernel from the same random state
  draw the same mask (equal outputs and gradients), and the op's random-number state has the device, dtype and
  shape its fake (compile-time) version declares;
- a small BERT classifier in bf16 autocast: the packed forward's logits and loss against the padded forward's;
- the Finetuner with --padding-free --torch-compile-mode reduce-overhead against the padded eager run (bf16,
  dropout off): the same losses within bf16 rounding, CUDA graphs recorded, none skipped.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _qkv(tokens, heads=4, dim=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(tokens, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)]


def test_varlen_op_matches_sdpa_per_segment():
    from megatron_patch.compat.flash_varlen import flash_varlen_attention

    _cuda()
    lengths = [5, 130, 1, 0, 77, 300, 19]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    q, k, v = _qkv(int(cu[-1]))
    out = flash_varlen_attention(q, k, v, cu, max_len=512, dropout_p=0.0, scale=0.125)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [out.detach()] + [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
            parts.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=0.125)[0].transpose(0, 1))
    ref = torch.cat(parts)
    ref.backward(grad)
    want = [ref.detach()] + [x.grad for x in (q, k, v)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_varlen_op_dropout_matches_sdpa_flash():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_patch.compat.flash_varlen import flash_varlen_attention

    _cuda()
    n, p = 200, 0.3
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    q, k, v = _qkv(n, seed=1)
    raw = torch.ops.megatron_patch.flash_varlen_fwd(q.detach(), k.detach(), v.detach(), cu, n, p, False, 0.125)
    fake_rng = torch.empty((2,), dtype=torch.uint64, device=q.device)
    assert (raw[2].device, raw[2].dtype, raw[2].shape) == (fake_rng.device, fake_rng.dtype, fake_rng.shape)
    grad = torch.randn(n, 4, 64, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(11)
    out = flash_varlen_attention(q, k, v, cu, max_len=n, dropout_p=p, scale=0.125)
    out.backward(grad)
    got = [out.detach()] + [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.manual_seed(11)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), dropout_p=p, scale=0.125)[0].transpose(0, 1)
    ref.backward(grad)
    want = [ref.detach()] + [x.grad for x in (q, k, v)]
    no_dropout = flash_varlen_attention(q.detach(), k.detach(), v.detach(), cu, n, 0.0, 0.125)
    assert (got[0] - no_dropout).abs().max() > 0.1  # the mask was applied
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_packed_bert_matches_padded_in_bf16():
    import transformers

    from megatron_patch.accelerations.padding_free import apply_padding_free
    from megatron_patch.data.flatten import FlattenCollator
    from test_padding_free import _pad, _samples

    device = _cuda()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=512, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="sdpa")
    ref = transformers.BertForSequenceClassification(cfg).to(device)
    packed = copy.deepcopy(ref)
    apply_padding_free(packed)
    samples = _samples()
    padded = {k: v.to(device) for k, v in _pad(samples).items()}
    row = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in FlattenCollator(_pad, 64, 64)(samples).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = ref(**padded), packed(**row)
    torch.testing.assert_close(b.logits.float(), a.logits.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(b.loss.float(), a.loss.float(), rtol=1e-2, atol=1e-2)


def test_packed_finetuner_with_cuda_graphs():
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    from test_padding_free import _whitebox

    device = _cuda()
    torch._dynamo.reset()
    eager = _whitebox(["--bf16"])
    torch._dynamo.reset()
    graphs = _whitebox(["--bf16", "--padding-free", "--torch-compile-mode", "reduce-overhead"])
    assert any("CUDA graphs per batch shape" in x for x in graphs["lines"]), graphs["lines"]
    assert any("multiple of 256" in x for x in graphs["lines"]), graphs["lines"]
    manager = get_manager(device.index or 0, create_if_none_exists=False)
    assert manager is not None and sum(len(v) for v in manager.roots.values()) > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(graphs["losses"]) == len(eager["losses"]) == 10
    assert graphs["losses"] == pytest.approx(eager["losses"], rel=2e-2, abs=2e-2)
