"""Black-box pretraining (`--task pretraining`): a PreTrainer that needs no user code.

The model directory (--pretrained-model-name-or-path) says what is trained: a BERT-style model (one with a
next-sentence head, e.g. BertForPreTraining) learns masked LM + next-sentence prediction on sentence data
(`tools/preprocess_data.py --split-sentences`, the `_text_sentence` prefix); a causal LM (GPT-2, Llama, ...)
learns next-token prediction on document data (the `_text_document` prefix). The shape flags (--num-layers,
--hidden-size, --num-attention-heads, --max-position-embeddings, --ffn-hidden-size) either match the directory's
config, and training starts from its weights, or they differ, and a model of the flags' shape starts from new
weights; the log says which. --hidden-dropout, --attention-dropout and --init-method-std go into the model's config;
a causal LM takes --eod-mask-loss and --reset-position-ids as Megatron-LM does (a BERT-style model refuses them, as
a causal LM refuses --mask-prob: config/flag_use.py). The trained model is written with `save_pretrained` to --save.
"""
from __future__ import annotations

import argparse
from typing import Dict, Tuple

import torch

from megatron_patch.config.rapidformer_flags import UsageError
from megatron_patch.config.flag_use import refuse_unused
from megatron_patch.templates.globals import get_logger
from megatron_patch.templates.pretrainer import PreTrainer
from megatron_patch.templates.rules.shape_flags import config_settings, mismatches


def model_kind(config) -> str:
    """'bert' (masked LM + next sentence) or 'causal' (next token), from a Hugging Face config."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_PRETRAINING_MAPPING

    if type(config) in MODEL_FOR_PRETRAINING_MAPPING and \
            "NextSentence" in "".join(config.architectures or []) + MODEL_FOR_PRETRAINING_MAPPING[type(config)].__name__:
        return "bert"
    if config.model_type in ("bert", "megatron-bert", "ernie"):
        return "bert"
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return "causal"
    raise ValueError(f"--task pretraining: the model in --pretrained-model-name-or-path is a {config.model_type!r}, "
                     "neither BERT-style (masked LM + next sentence) nor a causal LM; fine-tune it with another --task")


def shaped_config(args: argparse.Namespace, config, vocab_size: int) -> Tuple[object, Dict[str, Tuple]]:
    """The directory's config with the shape flags applied; returns it and {attribute: (directory, flags)} for
    every attribute that changed (empty: the directory's weights fit)."""
    changes = {}
    for flag, (name, current, value) in mismatches(args, config).items():
        if current is None:  # e.g. --ffn-hidden-size for a config without an MLP width: it cannot act
            raise UsageError(f"--{flag.replace('_', '-')} {value}: the {config.model_type} config in "
                             f"{args.pretrained_model_name_or_path} has no {name}; drop the flag")
        changes[name] = (current, value)
    if getattr(config, "vocab_size", None) is not None and vocab_size > config.vocab_size:
        changes["vocab_size"] = (config.vocab_size, vocab_size)
    if not changes:
        return config, changes
    config = type(config).from_dict(config.to_dict())
    for name, (_, new) in changes.items():
        setattr(config, name, new)
    if args.ffn_hidden_size is None:  # a new width without a new MLP width: the usual 4 x hidden size
        if "hidden_size" in changes and hasattr(config, "intermediate_size"):
            config.intermediate_size = 4 * config.hidden_size
        if "hidden_size" in changes and hasattr(config, "n_inner"):
            config.n_inner = None
    return config, changes


class BlackBoxPreTrainer(PreTrainer):
    def __init__(self, engine) -> None:
        super().__init__(engine)
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(self.args.pretrained_model_name_or_path)
        self.kind = model_kind(self.config)
        # what only the model's kind decides (--mask-prob for BERT, --eod-mask-loss for a causal LM ...); the
        # launching process has said it already (preflight), this covers a worker started another way
        refuse_unused(self.args, ("pt",), self.kind)
        if self.args.seq_length is None:
            self.args.seq_length = 128 if self.kind == "bert" else 512
            get_logger().info(f"--seq-length not given: using {self.args.seq_length}")
        get_logger().info(f"pretraining task: {'masked LM + next-sentence prediction' if self.kind == 'bert' else 'causal LM'} "
                          f"({self.config.model_type} in {self.args.pretrained_model_name_or_path})")

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        from megatron_patch.templates.gpt_samples import build_train_valid_test_datasets
        from megatron_patch.templates.pretraining_data import build_train_valid_test_datasets_for_huggingface

        a = self.args
        if self.kind == "bert":
            return build_train_valid_test_datasets_for_huggingface(
                data_prefix=a.data_path, data_impl=a.data_impl, splits_string=a.split,
                train_valid_test_num_samples=train_val_test_num_samples, max_seq_length=a.seq_length,
                masked_lm_prob=a.mask_prob, short_seq_prob=a.short_seq_prob, seed=a.seed,
                skip_warmup=not a.mmap_warmup, binary_head=True)
        return build_train_valid_test_datasets(
            data_prefix=a.data_path, data_impl=a.data_impl, splits_string=a.split,
            train_valid_test_num_samples=train_val_test_num_samples, seq_length=a.seq_length, seed=a.seed,
            skip_warmup=not a.mmap_warmup)

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoModelForCausalLM, AutoModelForPreTraining

        from megatron_patch.templates.pretraining_data import get_tokenizer

        auto = AutoModelForPreTraining if self.kind == "bert" else AutoModelForCausalLM
        path = self.args.pretrained_model_name_or_path
        config, changes = shaped_config(self.args, self.config, get_tokenizer().vocab_size)
        log = get_logger()
        settings = config_settings(self.args, config)  # --hidden-dropout, --attention-dropout, --init-method-std
        if settings:
            config = type(config).from_dict({**config.to_dict(), **settings})
            log.info("model config: " + ", ".join(f"{k} {v}" for k, v in settings.items())
                     + " (--hidden-dropout, --attention-dropout, --init-method-std)")
        if changes:
            what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())
            log.info(f"model: new weights (the shape flags differ from {path}: {what})")
            model = auto.from_config(config)
        else:
            log.info(f"model: starting from the weights in {path} (the shape flags match its config)")
            model = auto.from_pretrained(path, config=config)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        from megatron_patch.templates import mpu

        data = next(data_iterator) if data_iterator is not None else None
        if self.kind == "bert":
            keys = ["input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label"]
            return model(**mpu.broadcast_data(keys, data, torch.int64))["loss"]
        text = mpu.broadcast_data(["text"], data, torch.int64)["text"]
        tokens, labels = text[:, :-1], text[:, 1:]
        a = self.args
        if not (a.eod_mask_loss or a.reset_position_ids):
            logits = model(input_ids=tokens).logits
            # every position predicts the next token (seq_length predictions per sample, as the engine counts them)
            return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
        from megatron_patch.templates.gpt_samples import get_ltor_masks_and_position_ids
        from megatron_patch.templates.pretraining_data import get_tokenizer

        # Megatron-LM's masks: positions restart after each end-of-document token; no loss where one is the input
        _, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, get_tokenizer().eod, a.reset_position_ids,
                                                                     False, a.eod_mask_loss)
        logits = model(input_ids=tokens, position_ids=position_ids).logits
        losses = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                   reduction="none")
        loss_mask = loss_mask.reshape(-1)
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)

    def train(self):
        history = super().train()
        if self.args.save and getattr(self, "model", None) is not None:
            from megatron_patch.templates.pretraining_data import get_tokenizer
            from megatron_patch.templates.saving import save_pretrained

            save_pretrained(self.model, self.args.save)
            get_logger().info(f"saved the trained model to {self.args.save} (save_pretrained); the tokenizer is "
                              f"--vocab-file {self.args.vocab_file} ({type(get_tokenizer()).__name__})")
        return history
