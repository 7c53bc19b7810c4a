"""Supervised fine-tuning: chat data rendered with the model's template into tokens + a loss mask on the assistant
turns (preprocess_data.py --sft), SFT samples packed or padded, and the engine training on them: packed samples give
the losses and gradients of the same conversations padded one per sample, at TP1, TP2 with sequence parallelism and
PP2 with interleaving (which has stages that neither embed nor compute the loss)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import run_tool
from engine_utils import full_weights, per_iteration, run_engine, train_losses
from sft_utils import SEQ, sft_flags

CHATML_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And a cat?"},
    {"role": "assistant", "content": "A cat meows."},
]


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _read(prefix):
    from megatron_patch.data.indexed_dataset import IndexedDataset

    tokens, masks = IndexedDataset(prefix + "_text_document"), IndexedDataset(prefix + "_loss_mask_document")
    return [(tokens[i].tolist(), masks[i].tolist()) for i in range(len(tokens))]


def test_loss_mask_matches_a_hand_rendered_chatml_conversation(sft_data, tmp_path):
    """The template's text tokenized piece by piece as written by hand (ChatML): the ids are the pieces' ids back to
    back (no BOS/EOS added), and the mask is 1 exactly on each answer and its <|im_end|>\\n, over two turns."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft_data.tok)
    run_tool("preprocess_data.py", "--sft", "--input", _write(tmp_path / "c.jsonl", [{"messages": CHATML_CONVERSATION}]),
             "--tokenizer-model", sft_data.tok, "--output-prefix", str(tmp_path / "c"), "--seq-length", "512")
    [(ids, mask)] = _read(str(tmp_path / "c"))

    def piece(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    want_ids, want_mask = [], []
    for m in CHATML_CONVERSATION:
        header = piece("<|im_start|>") + piece(f"{m['role']}\n")
        if m["role"] == "assistant":
            body = piece(m["content"]) + piece("<|im_end|>") + piece("\n")
            want_ids += header + body
            want_mask += [0] * len(header) + [1] * len(body)
        else:
            body = piece(m["content"]) + piece("<|im_end|>") + piece("\n")
            want_ids += header + body
            want_mask += [0] * (len(header) + len(body))
    assert ids == want_ids
    assert mask == want_mask
    assert tok.decode([i for i, k in zip(ids, mask) if k]) == "Four.<|im_end|>\nA cat meows.<|im_end|>\n"


def _sft_main(capsys, *args):
    """preprocess_data.py --sft in this process (the CLI's main): (exit status, stderr)."""
    from megatron_patch.data.preprocess import main

    try:
        main(["--sft", *args])
        code = 0
    except SystemExit as e:
        code, message = 1, str(e.code)
        return code, capsys.readouterr().err + message
    return code, capsys.readouterr().err


LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Rewrites earlier turns (as Qwen3's drops earlier reasoning): the last message is marked, so prefixes do not match
REWRITING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (last){% endif %}\n"
                      "{{ m['content'] }}<|im_end|>\n{% endfor %}")


@pytest.mark.parametrize("template,answers", [
    (LLAMA3_TEMPLATE, "Four.<|eot_id|>A cat meows.<|eot_id|>"),
    (REWRITING_TEMPLATE, "Four.<|im_end|>A cat meows.<|im_end|>"),
])
def test_template_bos_and_rewritten_prefixes(sft_data, tmp_path, template, answers, capsys):
    """A template that writes the BOS itself gets exactly one (Llama 3: nothing is added on top); the mask of a
    template that does not render prefixes as prefixes is found from the answers' text (plus the EOS after them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft_data.tok)
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "t.jinja").write_text(template)
    code, err = _sft_main(capsys, "--input", _write(tmp_path / "c.jsonl", [{"messages": CHATML_CONVERSATION}]),
                          "--tokenizer-model", str(tmp_path / "tok"), "--chat-template", str(tmp_path / "t.jinja"),
                          "--output-prefix", str(tmp_path / "c"), "--seq-length", "512")
    assert code == 0, err
    [(ids, mask)] = _read(str(tmp_path / "c"))
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids.count(bos) == (1 if "bos_token" in template else 0) and (ids[0] == bos) == ("bos_token" in template)
    assert tok.decode([i for i, k in zip(ids, mask) if k]) == answers


def test_overflow_truncate_drop_and_bad_input(sft_data, tmp_path, capsys):
    """--overflow truncate cuts and counts, drop drops and counts; bad lines name file:line and the fix; a model
    without a chat template names --chat-template."""
    long = {"prompt": "Repeat: " + "red green blue " * 40, "response": "Done."}
    short = {"prompt": "What is 1 plus 2?", "response": "3."}
    path = _write(tmp_path / "c.jsonl", [short, long, {"messages": CHATML_CONVERSATION}])
    common = ["--input", path, "--tokenizer-model", sft_data.tok, "--seq-length", "48"]
    code, err = _sft_main(capsys, *common, "--output-prefix", str(tmp_path / "t"), "--overflow", "truncate")
    # the long prompt leaves no answer within 48 tokens: dropped; the two-turn conversation keeps its first answer
    assert code == 0 and "2 conversations" in err and "1 truncated and 1 dropped" in err
    kept = _read(str(tmp_path / "t"))
    assert len(kept[1][0]) == 48 and sum(kept[1][1]) > 0
    code, err = _sft_main(capsys, *common, "--output-prefix", str(tmp_path / "d"), "--overflow", "drop")
    assert "0 truncated and 2 dropped" in err and f"first dropped: {path}:2" in err
    assert len(_read(str(tmp_path / "d"))) == 1

    bad = {
        "not json": ("{oops", f"{tmp_path / 'b.jsonl'}:2: not a UTF-8 JSON line"),
        "no answer": ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
        "bad role": ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'; use one of"),
        "no keys": ({"text": "hi"}, "no \"messages\" and no \"prompt\"/\"response\""),
    }
    for name, (record, message) in bad.items():
        p = _write(tmp_path / "b.jsonl", [short, record])
        code, err = _sft_main(capsys, "--input", p, "--tokenizer-model", sft_data.tok, "--seq-length", "48",
                              "--output-prefix", str(tmp_path / "b"))
        assert code == 1 and message in err and "b.jsonl:2" in err, (name, err)
        assert not os.path.exists(tmp_path / "b_text_document.bin")  # nothing published
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft_data.tok)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    for f in ("chat_template.jinja",):
        if os.path.exists(tmp_path / "plain" / f):
            os.remove(tmp_path / "plain" / f)
    code, err = _sft_main(capsys, "--input", path, "--tokenizer-model", str(tmp_path / "plain"), "--seq-length", "48",
                          "--output-prefix", str(tmp_path / "p"))
    assert code == 1 and "has no chat template" in err and "--chat-template" in err


def test_sft_samples_packed_and_padded(sft_data):
    """Each epoch holds every training conversation once, packed (<= SEQ tokens a sample) or one per sample; within
    a sample, each conversation's labels are its own next tokens, its positions restart at 0 and the loss mask is
    the preprocessed mask of the predicted token."""
    from megatron_patch.data.sft_dataset import build_sft_datasets, open_sft

    tokens, masks = open_sft(sft_data.prefix)
    n = sft_data.conversations
    for pack in (True, False):
        per_epoch = sft_data.packed_samples if pack else n
        train, valid, test = build_sft_datasets(sft_data.prefix, SEQ, (2 * per_epoch, 1, 1), "100,0,0", 3, pack, 0)
        assert valid is None and test is None and len(train) == 2 * per_epoch
        for epoch in range(2):
            seen = np.concatenate([train.conversations(i) for i in range(epoch * per_epoch, (epoch + 1) * per_epoch)])
            assert sorted(seen.tolist()) == list(range(n))
        for i in range(len(train)):
            sample, at = train[i], 0
            for doc in train.conversations(i):
                ids, mask = tokens[doc].astype(np.int64), masks[doc].astype(np.int64)
                k = len(ids)
                assert (sample["tokens"][at:at + k] == ids).all()
                assert (sample["labels"][at:at + k - 1] == ids[1:]).all()
                assert (sample["loss_mask"][at:at + k - 1] == mask[1:]).all() and sample["loss_mask"][at + k - 1] == 0
                assert (sample["position_ids"][at:at + k] == np.arange(k)).all()
                at += k
            assert at <= SEQ and not sample["loss_mask"][at:].any()
            assert (sample["position_ids"][at:] == np.arange(SEQ - at)).all()
        if not pack:
            assert all(len(train.conversations(i)) == 1 for i in range(len(train)))
    assert train[0]["loss_mask"].sum() > 0


def test_packed_per_token_losses_and_gradients_equal_padded(sft_data, monkeypatch):
    """One process, the model itself: two packed samples through the engine's forward step (THD, our attention with
    the conversations' block-diagonal mask, RoPE restarting per conversation) give every position of every
    conversation the loss it has alone in a padded sample, and the summed masked loss the same gradients (fp32)."""
    import torch

    from megatron_patch.config import parse_args
    from megatron_patch.data.sft_dataset import build_sft_datasets
    from megatron_patch.models.gpt import build_gpt_model
    from megatron_patch.parallel import destroy, initialize
    from megatron_patch.training.data import tokenizer_from_config
    from megatron_patch.training.step import forward_step

    from engine_utils import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    cfg = initialize(parse_args(sft_flags(sft_data, "--micro-batch-size", "2", "--global-batch-size", "2")))
    try:
        model = build_gpt_model(cfg, tokenizer_from_config(cfg).vocab_size)
        packed = build_sft_datasets(sft_data.prefix, SEQ, (2, 1, 1), "100,0,0", 3, True, 0)[0]
        padded = build_sft_datasets(sft_data.prefix, SEQ, (sft_data.conversations, 1, 1), "100,0,0", 3, False, 0)[0]
        by_conversation = {int(padded.conversations(i)[0]): i for i in range(len(padded))}

        def run(samples, packed_flag):
            batch = {k: torch.from_numpy(np.stack([x[k] for x in samples])) for k in samples[0]}
            model.zero_grad()
            output, loss_func = forward_step(iter([batch]), model, packed=packed_flag, per_token_loss=True)
            summed, count, _ = loss_func(output)
            summed.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            return output.detach().reshape(len(samples), SEQ), int(count), grads

        pack_losses, pack_count, pack_grads = run([packed[0], packed[1]], True)
        docs = [int(d) for i in (0, 1) for d in packed.conversations(i)]
        assert len(docs) > 2  # several conversations per sample
        alone = [padded[by_conversation[d]] for d in docs]
        pad_losses, pad_count, pad_grads = run(alone, False)
        assert pack_count == pad_count > 0
        row = 0
        for i in (0, 1):
            at = 0
            for d in packed.conversations(i):
                n = len(padded.tokens[int(d)])
                torch.testing.assert_close(pack_losses[i, at:at + n - 1], pad_losses[row, :n - 1], rtol=1e-5,
                                           atol=1e-5, msg=lambda m, d=d: f"conversation {d}: {m}")
                at, row = at + n, row + 1
        for name, g in pad_grads.items():
            torch.testing.assert_close(pack_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    finally:
        destroy()


def test_packed_rope_in_one_pass_equals_megatron_cores_loop():
    """The canary of compat.rope.packed_rope_in_one_pass: RoPE of a packed tensor with positions restarting at
    every boundary equals megatron-core's sequence-by-sequence loop (plain and interleaved rotation)."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_patch.compat.registry import original
    from megatron_patch.compat.rope import _thd_rope_one_pass

    class OneRank:  # a context-parallel group of one
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 37, 38, 90, 128], dtype=torch.int32)
    t, freqs = torch.randn(128, 4, 16), torch.randn(52, 1, 1, 16)
    for interleaved in (False, True):
        want = original(rope_utils, "_apply_rotary_pos_emb_thd")(t, cu, freqs, rotary_interleaved=interleaved,
                                                                  cp_group=OneRank())
        got = _thd_rope_one_pass(t, cu, freqs, rotary_interleaved=interleaved, cp_group=OneRank())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def padded_run(sft_data, tmp_path_factory):
    """The reference: every conversation padded to its own sample, one process (global batch: all of them)."""
    d = tmp_path_factory.mktemp("padded")
    flags = sft_flags(sft_data, "--num-layers", "4", "--no-pack-sequences", "--micro-batch-size", "4",
                      "--global-batch-size", str(sft_data.conversations), "--save", str(d / "ckpt"))
    lines, _ = run_engine(d, 1, *flags, base=[])
    return lines, full_weights(str(d / "ckpt" / "iter_0000005"))


PACKED_LAYOUTS = {  # (processes, micro batch, flags); interleaving needs the micro batches a multiple of PP
    # slow (CI time): test_packed_per_token_losses_and_gradients_equal_padded is the one-process guard
    "tp1": pytest.param((1, 2, []), marks=pytest.mark.slow),
    "tp2_sp": (2, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_vpp": (2, 1, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
}


@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS.values()), ids=list(PACKED_LAYOUTS))
def test_packed_trains_like_padded(sft_data, padded_run, tmp_path, layout):
    """Packed samples (several conversations each) give the padded run's losses, gradient norms and
    weights (fp32, 1e-5), with the loss averaged per token over the global batch in both."""
    nproc, micro_batch, extra = layout
    flags = sft_flags(sft_data, "--num-layers", "4", "--micro-batch-size", str(micro_batch), "--global-batch-size",
                      str(sft_data.packed_samples), "--save", str(tmp_path / "ckpt"), *extra)
    lines, proc = run_engine(tmp_path, nproc, *flags, base=[])
    ref_lines, ref_weights = padded_run
    assert train_losses(lines) == pytest.approx(train_losses(ref_lines), rel=1e-5)
    assert train_losses(lines)[-1] < train_losses(lines)[0] - 0.3
    assert per_iteration(lines, "grad_norm") == pytest.approx(per_iteration(ref_lines, "grad_norm"), rel=1e-5)
    weights = full_weights(str(tmp_path / "ckpt" / "iter_0000005"))
    for k, w in ref_weights.items():
        np.testing.assert_allclose(weights[k].numpy(), w.numpy(), rtol=1e-5, atol=1e-5, err_msg=k)
