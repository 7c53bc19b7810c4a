"""Every `rapidformer` flag either acts or is refused (issue 27): the table of which flag acts in which kind of
run (config/flag_use.py) covers every flag; the seed documents' commands pass; a flag that a run would ignore is one
line naming it; and the flags that were ignored now act where that is natural: --hidden-dropout,
--attention-dropout and --init-method-std in the config of the model a black-box task loads, --eval-interval in
fine-tuning, --eod-mask-loss and --reset-position-ids in black-box causal pretraining.

Budgets (2 busy CPU cores): the table and rules checks are in-process, under 1 s each; the preflight checks read
config.json only (about 1 s); the in-process template runs (tiny Linear/BERT/GPT-2 models, no process group but
the PreTrainer's one-rank gloo group) 1-5 s each; one end-to-end run of the console script, about 10 s.
"""
from __future__ import annotations

import os
import shlex
import types

import pytest
import torch

from finetune_utils import ROOT, explain, minilm_dir, rapidformer, tiny_model

EXAMPLES = os.path.join(ROOT, "examples")
VOCAB = os.path.join(minilm_dir(), "vocab.txt")

# The seed documents' commands (how-to), hub names and paths replaced by local placeholders: they must run as
# written, so no flag of theirs may be refused. The kinds their templates check at train() are listed.
SEEDS = {
    "black-box fine-tuning": (
        "--task sequence_classification --pretrained-model-name-or-path M --data-path glue --data-name mrpc "
        "--epochs 3 --micro-batch-size 16 --global-batch-size 64 --lr 2e-5 --lr-decay-style linear "
        "--lr-warmup-iters 100 --weight-decay 1e-2 --clip-grad 1.0 --seed 42 --mixed-precision "
        "--onnx-runtime-training --zero-1-memory-optimization", ("ft",)),
    "black-box pretraining": (
        "--task pretraining --pretrained-model-name-or-path M --num-layers 12 --hidden-size 768 "
        "--num-attention-heads 12 --micro-batch-size 16 --global-batch-size 128 --seq-length 512 "
        "--tokenizer-type BertWordPieceLowerCase --max-position-embeddings 512 --train-iters 100 "
        "--data-path book_wiki_owtv2_small_text_sentence --vocab-file V --data-impl mmap --split 980,20 --lr 1e-3 "
        "--lr-decay-style linear --min-lr 0.0 --lr-decay-iters 2000 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction .01 --mixed-precision --onnx-runtime-training --fsdp-memory-optimization", ("pt",)),
    "Finetuner": (
        f"--user-script {EXAMPLES}/rapidformer_finetune_huggingface_bert_trainer.py --task sequence_classification "
        "--pretrained-model-name-or-path M --data-path glue --data-name mrpc --epochs 3 --micro-batch-size 16 "
        "--global-batch-size 16 --lr 2e-5 --lr-decay-style linear --lr-warmup-iters 100 --weight-decay 1e-2 "
        "--clip-grad 1.0 --mixed-precision --zero-3-memory-optimization --onnx-runtime-training", ("finetuner",)),
    "Hugging Face PreTrainer": (
        f"--user-script {EXAMPLES}/rapidformer_pretrain_huggingface_bert_trainer.py --pretrained-model-name-or-path M "
        "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --micro-batch-size 16 --global-batch-size 64 "
        "--seq-length 512 --tokenizer-type BertWordPieceLowerCase --max-position-embeddings 512 --train-iters 100 "
        "--data-path D --vocab-file V --data-impl mmap --split 980,20 --lr 1e-3 --lr-decay-style linear "
        "--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --zero-3-memory-optimization "
        "--onnx-runtime-training --mixed-precision", ("hf",)),
    "Megatron PreTrainer": (
        f"--user-script {EXAMPLES}/rapidformer_pretrain_megatron_gpt_trainer.py --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --num-layers 12 --hidden-size 768 --num-attention-heads 12 "
        "--micro-batch-size 16 --global-batch-size 128 --seq-length 512 --tokenizer-type GPT2BPETokenizer "
        "--max-position-embeddings 512 --train-iters 100 --data-path D --vocab-file gpt2-vocab.json "
        "--merge-file gpt2-merges.txt --data-impl mmap --split 980,20 --lr 1e-3 --lr-decay-style linear "
        "--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1 --zero-2-memory-optimization "
        "--checkpoint-activations --mixed-precision", ("mg",)),
    "README custom loop": (
        f"--user-script {EXAMPLES}/custom_trainer_loop.py --pretrained-model-name-or-path M --data-path D "
        "--train-iters 60 --lr-warmup-iters 6 --lr 5e-5 --micro-batch-size 16", ()),
}
FT = "--task sequence_classification --pretrained-model-name-or-path m --data-path d "
PT = ("--task pretraining --pretrained-model-name-or-path {model} --data-path d --tokenizer-type "
      "BertWordPieceLowerCase --vocab-file v --train-iters 5 --micro-batch-size 2 --global-batch-size 2 ")


def _args(cmd: str):
    from megatron_patch.config.rapidformer_flags import parse_args

    return parse_args(shlex.split(cmd))


def _checked(cmd: str, world: int = 4):
    from megatron_patch.templates.rules import check

    return check(_args(cmd), world_size=world)


# ---- the table -------------------------------------------------------------------------------------------------------
def test_the_table_places_every_flag_in_every_kind_of_run():
    """A new flag must say what it does in each kind of run; every refusal has its words."""
    from megatron_patch.config.rapidformer_flags import build_parser
    from megatron_patch.config.flag_use import KINDS, PLAIN, PURPOSE, TABLE, TRAITS

    dests = [a.dest for a in build_parser()._actions if a.dest != "help"]
    assert sorted(TABLE) == sorted(dests)
    for dest, cells in TABLE.items():
        assert tuple(cells) == KINDS and all(c in PLAIN or c in TRAITS for c in cells.values()), (dest, cells)
        if any(c not in ("acts", "config", "script") for c in cells.values()):
            assert PURPOSE.get(dest), dest


def test_given_records_what_the_command_line_set():
    """A flag left at its default is not `given`; one given with its default value is (the rules fill in defaults
    later and must not make them look given)."""
    a = _checked(f"--user-script {EXAMPLES}/custom_trainer_loop.py --split 969,30,1 --mixed-precision")
    assert a.split == "969,30,1" and {"user_script", "split", "mixed_precision"} <= a.given
    assert not {"eval_interval", "eval_iters", "epochs", "lr", "micro_batch_size", "save"} & a.given
    assert a.epochs == 3 and a.lr == 5e-5  # filled in by the rules, still not given


@pytest.mark.parametrize("name", list(SEEDS))
def test_the_seed_commands_pass(name):
    """(The rules' other checks are not run here: the seeds' --onnx-runtime-training needs a package this
    environment may lack, and ORT with ZeRO-3 is refused for its own reason.)"""
    from megatron_patch.config.flag_use import run_kinds, unused

    cmd, kinds = SEEDS[name]
    a = _args(cmd)
    assert unused(a, run_kinds(a)) == [], name  # the rules' refusal, before any worker
    for kind in kinds:  # what the template checks once it knows the run's kind (and the model's)
        assert unused(a, (kind,), "bert" if kind == "pt" else None) == [], (name, kind)


# ---- refusals, before any worker -------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, flag", [
    ("--split 980,20", "--split 980,20"),
    ("--split 969,30,1", "--split 969,30,1"),  # the default value, given: still refused
    ("--data-impl mmap", "--data-impl mmap"),
    ("--eval-iters 5", "--eval-iters 5"),
    ("--save-interval 10", "--save-interval 10"),
    ("--tokenizer-type BertWordPieceLowerCase --vocab-file v", "--tokenizer-type BertWordPieceLowerCase"),
    ("--mask-prob 0.3", "--mask-prob 0.3"),
    ("--short-seq-prob 0.2", "--short-seq-prob 0.2"),
    ("--mmap-warmup", "--mmap-warmup"),
    ("--eod-mask-loss", "--eod-mask-loss"),
    ("--data-cache-path c", "--data-cache-path c"),
    ("--data-iterator fixed-shape", "--data-iterator fixed-shape"),
    ("--make-vocab-size-divisible-by 64", "--make-vocab-size-divisible-by 64"),
    ("--num-layers-per-virtual-pipeline-stage 2", "--num-layers-per-virtual-pipeline-stage 2"),
])
def test_black_box_fine_tuning_refuses_what_it_ignores(extra, flag):
    from megatron_patch.config.rapidformer_flags import UsageError

    with pytest.raises(UsageError) as e:
        _checked(FT + extra)
    msg = str(e.value)
    assert msg.startswith(flag + ": ") and "Black-box fine-tuning (--task sequence_classification)" in msg, msg
    assert msg.endswith("drop it") or msg.endswith("drop them"), msg


def test_refusals_follow_the_task():
    """--mask-prob acts in masked LM only, --label-column in tasks with labels; several unused flags are one line;
    an explicit neutral value (--tensor-model-parallel-size 1) and --eval-interval are accepted in fine-tuning."""
    from megatron_patch.config.rapidformer_flags import UsageError

    _checked("--task masked_lm --pretrained-model-name-or-path m --data-path d --mask-prob 0.3")
    _checked(FT + "--label-column label --tensor-model-parallel-size 1 --eval-interval 5")
    with pytest.raises(UsageError, match=r"^--label-column x: .*--task masked_lm\) does not use it: drop it$"):
        _checked("--task masked_lm --pretrained-model-name-or-path m --data-path d --label-column x")
    with pytest.raises(UsageError) as e:
        _checked(FT + "--split 9,1 --eval-iters 2 --reset-position-ids")
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("uses none of them: drop them"), msg
    assert all(f in msg for f in ("--split 9,1: ", "--eval-iters 2: ", "--reset-position-ids: "))


def test_scripts_are_refused_only_what_no_template_reads():
    """A --user-script may be a Finetuner or a PreTrainer: the rules refuse a flag no template reads; --task of a
    fine-tuning kind declares a Finetuner; --task pretraining's rules refuse fine-tuning's flags."""
    from megatron_patch.config.rapidformer_flags import UsageError

    script = f"--user-script {EXAMPLES}/custom_trainer_loop.py "
    _checked(script + "--eval-iters 3 --epochs 2 --split 9,1")  # a PreTrainer reads --eval-iters, a script --split
    with pytest.raises(UsageError, match=r"^--reset-attention-mask: .*A Finetuner or PreTrainer script does not"):
        _checked(script + "--reset-attention-mask")
    with pytest.raises(UsageError, match=r"^--eval-iters 3: .*A Finetuner script does not use it"):
        _checked(script + "--task sequence_classification --eval-iters 3")
    with pytest.raises(UsageError, match=r"^--data-name x: .*--epochs 2: .*--task pretraining uses none of them"):
        _checked(PT.format(model="m") + "--data-name x --epochs 2", world=1)
    with pytest.raises(UsageError, match=r"^--merge-file x: the BPE merges of --tokenizer-type GPT2BPETokenizer"):
        _checked(PT.format(model="m") + "--merge-file x", world=1)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Model directories holding only config.json (all the launching process reads)."""
    import transformers as T

    d = tmp_path_factory.mktemp("configs")
    out = {}
    for name, config in (("bert", T.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2)),
                         ("gpt2", T.GPT2Config(n_layer=2, n_embd=32, n_head=2)),
                         ("llama", T.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                 intermediate_size=64))):
        config.save_pretrained(str(d / name))
        out[name] = str(d / name)
    return out


def test_blackbox_pretraining_model_kind_decides_the_data_flags(configs):
    """The model directory says BERT (masked LM: --mask-prob, --short-seq-prob) or causal LM (--eod-mask-loss,
    --reset-position-ids); the other kind's flags are refused by the launching process."""
    from megatron_patch.config.rapidformer_flags import UsageError
    from megatron_patch.cli.preflight import check_shapes

    def run(model, extra):
        check_shapes(_checked(PT.format(model=configs[model]) + extra, world=1))

    run("bert", "--mask-prob 0.2 --short-seq-prob 0.05")
    run("gpt2", "--eod-mask-loss --reset-position-ids")
    with pytest.raises(UsageError, match=r"^--eod-mask-loss: .*--task pretraining of a BERT-style model does not"):
        run("bert", "--eod-mask-loss")
    with pytest.raises(UsageError, match=r"^--mask-prob 0.2: .*--task pretraining of a causal LM does not use it"):
        run("gpt2", "--mask-prob 0.2")


def test_a_setting_the_config_lacks_is_refused(configs):
    """--hidden-dropout for a Llama (attention dropout only): refused by the launching process, fine-tuning and
    pretraining alike; --attention-dropout is taken."""
    from megatron_patch.cli.preflight import check_shapes
    from megatron_patch.config import ConfigError

    check_shapes(_checked(PT.format(model=configs["llama"]) + "--attention-dropout 0.1", world=1))
    with pytest.raises(ConfigError, match=r"^--hidden-dropout 0.2: the llama config has no such setting"):
        check_shapes(_checked(PT.format(model=configs["llama"]) + "--hidden-dropout 0.2", world=1))
    with pytest.raises(ConfigError, match=r"^--hidden-dropout 0.2: the llama config has no such setting"):
        check_shapes(_checked(f"--task causal_lm --pretrained-model-name-or-path {configs['llama']} --data-path d "
                              "--hidden-dropout 0.2", world=1))


def test_console_script_refuses_an_ignored_flag_in_one_line(tmp_path):
    """The user's path: the real `rapidformer` command, exit status 2, one line, no worker started."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation"):
        (data / f"{split}.jsonl").write_text("".join(f'{{"sentence": "s {i}", "label": {i % 2}}}\n' for i in range(8)))
    model = tiny_model("bert", str(tmp_path / "bert"))
    proc = rapidformer("--task", "sequence_classification", "--pretrained-model-name-or-path", model, "--data-path",
                       str(data), "--epochs", "1", "--eval-iters", "5", "--nproc-per-node", "2", timeout=300)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, explain(proc)
    assert lines[0].startswith("rapidformer: error: --eval-iters 5: validation batches per pretraining evaluation; "
                               "fine-tuning evaluates the whole validation split"), lines[0]


# ---- refusals in the templates (a --user-script's kind is known when train() runs) -----------------------------------
def _engine(args):
    return types.SimpleNamespace(args=args, device=torch.device("cpu"), world_size=1, rank=0, precision=None)


def test_templates_refuse_what_their_kind_ignores():
    from megatron_patch.config import ConfigError
    from megatron_patch.templates.finetuner import Finetuner
    from megatron_patch.templates.pretrainer import PreTrainer

    script = f"--user-script {EXAMPLES}/custom_trainer_loop.py "
    with pytest.raises(ConfigError, match=r"^--eval-iters 3: .*A Finetuner script does not use it: drop it$"):
        Finetuner(_engine(_checked(script + "--eval-iters 3 --epochs 1", world=1))).train()
    with pytest.raises(ConfigError, match=r"^--epochs 2: passes over a fine-tuning training set.*--eval-at-start"):
        PreTrainer(_engine(_checked(script + "--train-iters 4 --epochs 2 --eval-at-start", world=1))).train()


class _LinearPreTrainer:
    """A PreTrainer whose model is a plain torch module (the Hugging Face/PyTorch path)."""

    @staticmethod
    def build(engine):
        from megatron_patch.templates.pretrainer import PreTrainer

        class P(PreTrainer):
            def train_valid_test_datasets_provider(self, counts):
                return [{"x": torch.ones(4)}] * counts[0], None, None

            def model_optimizer_lr_scheduler_provider(self):
                return torch.nn.Linear(4, 1), None, None

            def run_forward_step(self, data_iterator, model):
                return model(next(data_iterator)["x"]).sum()

        return P(engine)


def test_hugging_face_pretrainer_refuses_megatron_only_flags(monkeypatch):
    """Once the model is known to be a Hugging Face/PyTorch one, the Megatron-only flags (--make-vocab-size-
    divisible-by, --num-experts, virtual pipeline stages) are refused before training."""
    from megatron_patch.config import ConfigError
    from megatron_patch.parallel.initialize import destroy

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    args = _checked(f"--user-script {EXAMPLES}/custom_trainer_loop.py --train-iters 2 --micro-batch-size 2 "
                    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                    f"--max-position-embeddings 16 --data-path d --tokenizer-type BertWordPieceLowerCase --vocab-file "
                    f"{VOCAB} --make-vocab-size-divisible-by 64", world=1)
    try:
        with pytest.raises(ConfigError, match=r"^--make-vocab-size-divisible-by 64: .*A PreTrainer with a Hugging "
                                              r"Face model does not use it: drop it$"):
            _LinearPreTrainer.build(_engine(args)).train()
    finally:
        destroy()
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)


def test_megatron_pretrainer_takes_the_compile_mode():
    """--torch-compile-mode reaches the engine (its compile_mode), which the Megatron PreTrainer used to drop."""
    from megatron_patch.templates.pretrain_megatron import engine_config

    args = _checked(f"--user-script {EXAMPLES}/rapidformer_pretrain_megatron_gpt_trainer.py --train-iters 2 "
                    "--torch-compile-mode max-autotune-no-cudagraphs", world=1)
    cfg = engine_config(args)
    assert cfg.compile and cfg.compile_mode == "max-autotune-no-cudagraphs"
    base = engine_config(args, accelerations=False)  # before the model says its kind: no switches
    assert not base.compile and base.compile_mode == "default"



@pytest.mark.parametrize("flag", ["override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"])
def test_megatron_pretrainer_takes_the_resume_schedule_choice(flag):
    """The engine refuses a resume whose schedule flags changed unless one of these two flags chooses (config/
    resume.py); a Megatron PreTrainer run must be able to pass them, and so must the Hugging Face PreTrainer's
    (white box and --task pretraining: the same rule, templates/resume_hf.py); fine-tuning resumes nothing."""
    from megatron_patch.templates.pretrain_megatron import engine_config

    option = "--" + flag.replace("_", "-")
    args = _checked(f"--user-script {EXAMPLES}/rapidformer_pretrain_megatron_gpt_trainer.py --train-iters 2 "
                    f"--load /ckpt {option}", world=1)
    assert getattr(engine_config(args), flag) and getattr(engine_config(args, accelerations=False), flag)
    from megatron_patch.config.flag_use import TABLE

    assert TABLE[flag] == {"ft": "no", "finetuner": "no", "pt": "acts", "hf": "acts", "mg": "acts"}

def test_a_script_model_must_hold_the_setting_flags():
    """A Finetuner/PreTrainer script builds its own model: --hidden-dropout that its config does not hold is refused
    (it would be ignored), one it holds passes."""
    import transformers as T

    from megatron_patch.config import ConfigError
    from megatron_patch.templates.rules.shape_flags import check_shape_flags

    model = T.BertModel(T.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     hidden_dropout_prob=0.1, initializer_range=0.02))
    check_shape_flags(_args("--hidden-dropout 0.1 --init-method-std 0.02"), model, "the script")
    with pytest.raises(ConfigError, match=r"^--hidden-dropout 0.3 --init-method-std 0.05: the model from the script "
                                          r"has hidden_dropout_prob 0.1, initializer_range 0.02 in its config"):
        check_shape_flags(_args("--hidden-dropout 0.3 --init-method-std 0.05"), model, "the script")


# ---- flags that now act --------------------------------------------------------------------------------------------
class _Counting:
    """A Finetuner on a linear model: records after how many optimizer steps each evaluation ran."""

    @staticmethod
    def build(engine):
        from megatron_patch.templates.finetuner import Finetuner

        class F(Finetuner):
            steps, evaluations = 0, []

            def train_valid_test_datasets_provider(self):
                data = [{"x": torch.full((4,), float(i)), "y": torch.tensor(float(i % 3))} for i in range(32)]
                return data, data[:8], None, torch.utils.data.default_collate

            def model_optimizer_lr_scheduler_provider(self):
                return torch.nn.Linear(4, 1), None, None

            def run_forward_step(self, batch, model):
                self.steps += 1  # no accumulation: one forward per optimizer step
                return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()

            def run_compute_metrics(self, model, loader):
                self.evaluations.append(self.steps)
                return {"batches": float(len(loader))}

        return F(engine)


@pytest.mark.parametrize("extra, at", [
    ("", [8, 16]),                              # after every epoch (8 steps of 4 samples)
    ("--eval-interval 3", [3, 6, 8, 9, 12, 15, 16]),
    ("--eval-interval 4", [4, 8, 12, 16]),      # an epoch end just evaluated is not evaluated twice
])
def test_eval_interval_evaluates_every_n_fine_tuning_steps(extra, at, tmp_path):
    script = f"--user-script {EXAMPLES}/custom_trainer_loop.py --epochs 2 --micro-batch-size 4 --lr 1e-3 "
    args = _checked(script + extra + f" --metrics-file {tmp_path}/m.jsonl", world=1)
    f = _Counting.build(_engine(args))
    f.evaluations = []
    f.train()
    assert f.evaluations == at
    import json

    with open(tmp_path / "m.jsonl") as fh:
        assert [json.loads(x)["step"] for x in fh] == at


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    data = d / "data"
    data.mkdir()
    for split in ("train", "validation"):
        (data / f"{split}.jsonl").write_text("".join(f'{{"sentence": "s {i}", "label": {i % 2}}}\n' for i in range(8)))
    return {"bert": tiny_model("bert", str(d / "bert")), "gpt2": tiny_model("gpt2", str(d / "gpt2")),
            "data": str(data)}


def test_blackbox_fine_tuning_puts_dropout_and_init_in_the_model_config(tiny_dirs):
    """--hidden-dropout, --attention-dropout and --init-method-std reach the model a fine-tuning task loads: its
    dropout layers and the new classification head's init (std 0.5 instead of the config's 0.02)."""
    from megatron_patch.cli.tasks.classification import SequenceClassification
    from megatron_patch.templates.globals import set_args

    args = _checked(f"--task sequence_classification --pretrained-model-name-or-path {tiny_dirs['bert']} --data-path "
                    f"{tiny_dirs['data']} --hidden-dropout 0.3 --attention-dropout 0.2 --init-method-std 0.5", world=1)
    set_args(args)
    model, _, _ = SequenceClassification(_engine(args)).model_optimizer_lr_scheduler_provider()
    assert (model.config.hidden_dropout_prob, model.config.attention_probs_dropout_prob) == (0.3, 0.2)
    p = {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert p["bert.encoder.layer.0.attention.self.dropout"] == 0.2 and p["bert.embeddings.dropout"] == 0.3
    assert p["bert.encoder.layer.1.output.dropout"] == 0.3 and p["dropout"] == 0.3
    assert 0.35 < model.classifier.weight.std().item() < 0.65  # 128 draws of N(0, 0.5)


def test_blackbox_causal_pretraining_masks_eod_loss_and_resets_positions(tiny_dirs):
    """--eod-mask-loss and --reset-position-ids in --task pretraining of a causal LM: the loss is the mean over
    tokens whose input is not end-of-document, with positions restarting after each one (Megatron-LM's masks),
    computed here independently, position by position."""
    from megatron_patch.cli.tasks.pretraining import BlackBoxPreTrainer
    from megatron_patch.templates.globals import set_args
    from megatron_patch.templates.pretraining_data import get_tokenizer

    args = _checked(f"--task pretraining --pretrained-model-name-or-path {tiny_dirs['gpt2']} --data-path d "
                    f"--tokenizer-type BertWordPieceLowerCase --vocab-file {VOCAB} --train-iters 1 "
                    "--micro-batch-size 2 --eod-mask-loss --reset-position-ids --hidden-dropout 0.0", world=1)
    set_args(args)
    trainer = BlackBoxPreTrainer(_engine(args))
    model, _, _ = trainer.model_optimizer_lr_scheduler_provider()
    assert model.config.resid_pdrop == 0.0 and model.config.embd_pdrop == 0.0  # --hidden-dropout acted
    model.eval()
    eod = get_tokenizer().eod
    g = torch.Generator().manual_seed(0)
    text = torch.randint(1000, 2000, (2, 13), generator=g)
    text[0, 4], text[0, 9], text[1, 6] = eod, eod, eod
    loss = trainer.run_forward_step(iter([{"text": text}]), model)
    tokens, labels = text[:, :-1], text[:, 1:]
    positions = torch.zeros_like(tokens)
    for row in range(tokens.shape[0]):
        start = 0
        for t in range(tokens.shape[1]):
            positions[row, t] = t - start
            if tokens[row, t] == eod:
                start = t + 1
    keep = tokens != eod
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=positions).logits
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    assert abs(loss.item() - per_token[keep].mean().item()) < 1e-5
    plain = BlackBoxPreTrainer(_engine(_checked(f"--task pretraining --pretrained-model-name-or-path "
                                                f"{tiny_dirs['gpt2']} --data-path d --tokenizer-type "
                                                f"BertWordPieceLowerCase --vocab-file {VOCAB} --train-iters 1", 1)))
    assert abs(plain.run_forward_step(iter([{"text": text}]), model).item() - loss.item()) > 1e-3
