"""Black-box fine-tuning: `--task` names a Finetuner subclass that needs no user code."""
from __future__ import annotations

import argparse


def task_class(task: str):
    from .classification import SequenceClassification
    from .language_modeling import CausalLM, MaskedLM
    from .question_answering import QuestionAnswering
    from .seq2seq import Seq2SeqLM
    from .token_classification import TokenClassification

    return {"sequence_classification": SequenceClassification, "token_classification": TokenClassification,
            "question_answering": QuestionAnswering, "masked_lm": MaskedLM, "causal_lm": CausalLM,
            "casual_lm": CausalLM, "seq2seq_lm": Seq2SeqLM}[task]


def run_task(args: argparse.Namespace):
    """Fine-tune (or, --task pretraining, pretrain) --pretrained-model-name-or-path on --data-path for --task;
    returns the last validation metrics (pretraining: the per-iteration history)."""
    from megatron_patch.templates.engine import RapidformerEngine

    engine = RapidformerEngine(args)
    if args.task == "pretraining":
        from .pretraining import BlackBoxPreTrainer

        return BlackBoxPreTrainer(engine).train()
    return task_class(args.task)(engine).train()
