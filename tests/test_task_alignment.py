"""What the black-box tasks feed the model and read back from it, at unit level, with the real MiniLM WordPiece
tokenizer (no model training): each task is built as `rapidformer --task T` builds it, on small hand-made
files, and what it computes is compared with an independent computation from the tokenizer's character offsets.

- token_classification: a word's tag goes on its FIRST piece, every other piece and the special tokens get
  -100 (words here split into up to five pieces, lose an accent or become [UNK]); and the entity F1 reads the
  prediction of each word's first piece (a stand-in model whose logits the test chooses per piece).
- question_answering: the training start/end token of each answer from its character span (an answer in
  pieces, one that ends the context, one that ends the truncated window, one across the window's end or past
  it and an empty answer -> token 0, a repeated answer found by its start, not by searching); and the
  evaluation's span (best start <= end within 30 tokens, context tokens only, cut from the context by offsets)
  against a brute-force search, the exact-match/F1 too.
- seq2seq_lm: each split is generated up to its own longest target (validation shorter than test here).

Budget: about 5 s in all (three small task instances, no training; a tiny BART generates a few tokens).
"""
from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_patch.cli.tasks import metrics as M

SEQ_LENGTH = 24  # --seq-length: the question_answering contexts below are truncated at it


def _write(folder, splits: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    for split, rows in splits.items():
        with open(os.path.join(folder, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return str(folder)


def _task(task: str, data: str, model: str):
    """The task object `rapidformer --task <task>` trains with (one worker, this process)."""
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.cli.tasks import task_class
    from megatron_patch.templates.engine import RapidformerEngine

    argv = ["--task", task, "--pretrained-model-name-or-path", model, "--data-path", data, "--micro-batch-size", "2",
            "--epochs", "1", "--seq-length", str(SEQ_LENGTH)]
    return task_class(task)(RapidformerEngine(check(parse_args(argv), world_size=1)))


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(minilm_dir)


# ================================================================ token_classification

TAGGED = [  # words that split into several pieces: un ##bel ##ie ##va ##bly, sequence ##mat ##cher, os . path ...
    (["The", "unbelievably", "naïve", "tokenization", "of", "SequenceMatcher", "calls", "os.path.join()", "twice"],
     ["O", "B-X", "I-X", "I-X", "O", "B-Y", "O", "B-Y", "O"]),
    (["max_size", "is", "1024", "bytes"], ["B-Y", "O", "B-N", "O"]),
    (["☃", "Unaffordable", "housing"], ["B-N", "B-X", "I-X"]),  # a snowman is [UNK]: one piece
    (["Preprocessing", "tokenizers"], ["O", "B-Y"]),
]
# the stand-in model's prediction for each word's FIRST piece (some right, some wrong); other pieces predict "O"
PREDICTED = [["O", "B-X", "I-X", "O", "O", "B-Y", "O", "B-X", "O"], ["B-Y", "O", "B-N", "B-N"],
             ["B-N", "B-X", "I-X"], ["O", "O"]]


@pytest.fixture(scope="module")
def tagging(tmp_path_factory, minilm_dir):
    rows = [{"tokens": w, "tags": t} for w, t in TAGGED]
    data = _write(tmp_path_factory.mktemp("tc"), {"train": rows, "validation": rows[::-1]})
    task = _task("token_classification", data, minilm_dir)
    return task, {split: task.prepare(split, task.datasets[split]) for split in ("train", "validation")}


def _first_piece_labels(words, tags, tokenizer, label_id):
    """Input ids and labels computed from the offsets of the words joined by spaces: the piece that starts a
    word carries its tag, every other piece and the special tokens -100."""
    text, starts, position = " ".join(words), [], 0
    for w in words:
        starts.append(position)
        position += len(w) + 1
    enc = tokenizer(text, return_offsets_mapping=True, truncation=True, max_length=SEQ_LENGTH)
    labels, word_of_piece = [], []
    for a, b in enc["offset_mapping"]:
        if a == b:  # [CLS], [SEP]
            labels.append(-100)
            word_of_piece.append(None)
            continue
        w = max(i for i, s in enumerate(starts) if s <= a)
        labels.append(label_id[tags[w]] if a == starts[w] else -100)
        word_of_piece.append(w)
    return enc["input_ids"], labels, word_of_piece


def test_token_labels_on_the_first_piece_of_each_word(tagging, tokenizer):
    task, prepared = tagging
    names = sorted({t for _, tags in TAGGED for t in tags})  # class ids: the sorted tag names of train
    assert task.labels == names
    label_id = {n: i for i, n in enumerate(names)}
    several = 0
    for split, rows in (("train", TAGGED), ("validation", TAGGED[::-1])):
        for got, (words, tags) in zip(prepared[split], rows):
            ids, labels, word_of_piece = _first_piece_labels(words, tags, tokenizer, label_id)
            assert got["input_ids"] == ids, (words, tokenizer.convert_ids_to_tokens(got["input_ids"]))
            assert got["labels"] == labels, (words, tokenizer.convert_ids_to_tokens(ids), got["labels"], labels)
            assert sum(l != -100 for l in labels) == len(words)  # every word is labelled once
            several += sum(word_of_piece.count(w) > 1 for w in range(len(words)))
    assert several >= 10  # the property is exercised: many words are several pieces


class PieceOracle(torch.nn.Module):
    """A stand-in token classifier (the model is not under test): for each row of input ids it knows, the logits
    the test chose per piece; padding positions predict a tag too, which must never be read."""

    def __init__(self, table: dict, num_labels: int) -> None:
        super().__init__()
        self.table, self.num_labels = table, num_labels

    def forward(self, input_ids, attention_mask, **_):
        out = torch.zeros(*input_ids.shape, self.num_labels)
        out[..., 1] = 1.0  # padding: a B- tag
        for row, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            n = sum(mask)
            out[row, :n] = self.table[tuple(ids[:n])]
        return SimpleNamespace(logits=out)


def test_entity_f1_reads_each_words_first_piece(tagging, tokenizer):
    task, prepared = tagging
    label_id = task.label2id
    rows, predicted = TAGGED[::-1], PREDICTED[::-1]  # the validation split
    table = {}
    for (words, tags), guess in zip(rows, predicted):
        ids, _, word_of_piece = _first_piece_labels(words, tags, tokenizer, label_id)
        logits = torch.zeros(len(ids), len(label_id))
        previous = None
        for t, w in enumerate(word_of_piece):
            tag = guess[w] if w is not None and w != previous else "O" if w is not None else "B-Y"
            logits[t, label_id[tag]] = 5.0
            previous = w
        table[tuple(ids)] = logits
    loader = task.build_data_loader(prepared["validation"], collate_fn=task.collate_fn())
    got = task.metrics(PieceOracle(table, len(label_id)), loader)
    expected = M.entity_f1(predicted, [tags for _, tags in rows])
    assert 0 < expected["f1"] < 1 and expected["accuracy"] < 1
    assert got == pytest.approx(expected, abs=1e-12), (got, expected)


# ================================================================ question_answering

LONG = ("The parser calls SequenceMatcher before returning the naïve max_size value of 1024 bytes and then it "
        "stops reading more of the unbelievably long stream here.")
TWICE = "It imports os.path.join(), then os.path.join() again."
QUESTIONS = [  # (context, answer, its start); row i is asked "Which <i+1 in words>?" (one token for every row)
    (LONG, "SequenceMatcher", LONG.index("SequenceMatcher")),  # three pieces, inside the window
    (LONG, "naïve", LONG.index("naïve")),  # the accent is stripped in the token, not in the offsets
    (LONG, "1024", LONG.index("1024")),  # its last piece is the window's last context token
    (LONG, "1024 bytes", LONG.index("1024")),  # across the window's end: token 0
    (LONG, "unbelievably", LONG.index("unbelievably")),  # past the window: token 0
    ("The default size is 1024", "1024", 20),  # ends the context
    (TWICE, "os.path.join()", TWICE.rindex("os.path.join()")),  # the second occurrence, by its start
    ("Nothing to find here.", None, None),  # no answer: token 0
]


@pytest.fixture(scope="module")
def qa(tmp_path_factory, minilm_dir):
    rows = [{"id": str(i), "question": _question(i), "context": c,
             "answers": {"text": [a] if a else [], "answer_start": [s] if a else []}}
            for i, (c, a, s) in enumerate(QUESTIONS)]
    data = _write(tmp_path_factory.mktemp("qa"), {"train": rows, "validation": rows})
    task = _task("question_answering", data, minilm_dir)
    return task, {split: task.prepare(split, task.datasets[split]) for split in ("train", "validation")}


def _question(row: int) -> str:
    """A question of the same length for every row, but its own: the stand-in model tells rows by their tokens."""
    return f"Which {'one two three four five six seven eight'.split()[row]}?"


def _qa_encoding(tokenizer, row: int):
    return tokenizer(_question(row), QUESTIONS[row][0], truncation="only_second", max_length=SEQ_LENGTH,
                     return_offsets_mapping=True)


def _context_offsets(enc) -> list:
    return [o if s == 1 else None for o, s in zip(enc["offset_mapping"], enc.sequence_ids())]


def test_answer_positions_from_the_character_span(qa, tokenizer):
    """Start/end tokens from transformers' char_to_token (a lookup of its own, not the task's offset scan):
    both ends inside the (truncated) context, else token 0; and the span cut from the context is the answer."""
    task, prepared = qa
    seen = set()
    for i, (got, (context, answer, start_char)) in enumerate(zip(prepared["train"], QUESTIONS)):
        enc = _qa_encoding(tokenizer, i)
        assert got["input_ids"] == enc["input_ids"]
        expected = (0, 0)
        if answer is not None:
            first = enc.char_to_token(start_char, sequence_index=1)
            last = enc.char_to_token(start_char + len(answer) - 1, sequence_index=1)
            if first is not None and last is not None:
                expected = (first, last)
                offsets = enc["offset_mapping"]
                assert context[offsets[first][0]:offsets[last][1]] == answer  # recovered exactly
                seen.add("window end" if last == len(enc["input_ids"]) - 2 else "inside")
                seen.add("context end" if offsets[last][1] == len(context) else "pieces" if last > first else "")
            else:
                seen.add("across the end" if first is not None else "past the end")
        assert (got["start_positions"], got["end_positions"]) == expected, (context, answer, expected)
    assert seen >= {"window end", "inside", "context end", "pieces", "across the end", "past the end"}, seen


def _brute_force_span(context, offsets, start_logits, end_logits, longest=30) -> str:
    best, span = None, None
    context_tokens = [t for t, o in enumerate(offsets) if o is not None]
    for s in context_tokens:
        for e in context_tokens:
            if s <= e < s + longest:
                score = float(start_logits[s]) + float(end_logits[e])
                if best is None or score > best:
                    best, span = score, (s, e)
    return "" if span is None else context[offsets[span[0]][0]:offsets[span[1]][1]]


def test_best_span_against_brute_force(tokenizer):
    from megatron_patch.cli.tasks.question_answering import MAX_ANSWER_TOKENS, QuestionAnswering

    assert MAX_ANSWER_TOKENS == 30
    long_context = " ".join([LONG] * 3)
    enc = tokenizer("Which one?", long_context, truncation="only_second", max_length=96, return_offsets_mapping=True)
    offsets = _context_offsets(enc)
    n = len(offsets)
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        s, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
        if trial % 3 == 0:  # the best logits on the question and on [CLS]/[SEP], which must not be chosen
            s[1], e[2], s[0], e[-1] = 9.0, 9.0, 9.0, 9.0
        if trial % 3 == 1:  # the best end before the best start
            s[40], e[20] = 6.0, 6.0
        got = QuestionAnswering._best_span(long_context, offsets, s, e)
        assert got == _brute_force_span(long_context, offsets, s, e), trial
    # a span of 31 tokens scores best of all: the best of at most 30 tokens is taken instead
    s, e = torch.zeros(n), torch.zeros(n)
    first = offsets.index(next(o for o in offsets if o is not None))
    s[first + 2], e[first + 32], e[first + 30] = 10.0, 10.0, 4.0
    got = QuestionAnswering._best_span(long_context, offsets, s, e)
    assert got == long_context[offsets[first + 2][0]:offsets[first + 30][1]]


class SpanOracle(torch.nn.Module):
    """A stand-in QA model (the model is not under test): start/end logits chosen by the test per known row;
    padding positions score highest of all, and must never be chosen."""

    def __init__(self, table: dict) -> None:
        super().__init__()
        self.table = table

    def forward(self, input_ids, attention_mask, **_):
        start, end = torch.full(input_ids.shape, 50.0), torch.full(input_ids.shape, 50.0)
        for row, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            n = sum(mask)
            start[row, :n], end[row, :n] = self.table[tuple(ids[:n])]
        return SimpleNamespace(start_logits=start, end_logits=end, loss=None)


def test_answers_extracted_at_evaluation(qa, tokenizer):
    """The exact match and F1 of the task's evaluation equal those of the brute-force spans of the same logits:
    half the rows' logits point at the gold answer (ends of the window included), the others are random."""
    task, prepared = qa
    g = torch.Generator().manual_seed(1)
    table, predictions, references = {}, [], []
    for i, (context, answer, start_char) in enumerate(QUESTIONS):
        enc = _qa_encoding(tokenizer, i)
        offsets, n = _context_offsets(enc), len(enc["input_ids"])
        s, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
        if answer is not None and i % 2 == 0:
            first = enc.char_to_token(start_char, sequence_index=1)
            last = enc.char_to_token(start_char + len(answer) - 1, sequence_index=1)
            if first is not None and last is not None:
                s[first], e[last] = 8.0, 8.0
        table[tuple(enc["input_ids"])] = (s, e)
        predictions.append(_brute_force_span(context, offsets, s, e))
        references.append([answer] if answer else [""])
    expected = M.squad(predictions, references)
    assert 0 < expected["exact_match"] < 1
    loader = task.build_data_loader(prepared["validation"], collate_fn=task.collate_fn())
    got = task.metrics(SpanOracle(table), loader)
    assert got == pytest.approx(expected, abs=1e-12), (got, expected, predictions)


# ================================================================ seq2seq_lm

def _headline(i: int, words: int) -> str:
    vocabulary = "parser tokenizer stream buffer socket module header checksum".split()
    return " ".join(random.Random(i).choice(vocabulary) for _ in range(words))


def test_each_split_generates_up_to_its_own_longest_target(tmp_path, minilm_dir, tokenizer):
    """Validation targets of 2-4 words, test targets of 12-14: evaluating validation generates exactly its own
    longest tokenized target, the test split its own (the lengths differ, so the wrong split's shows)."""
    import transformers

    def rows(first, sizes):
        return [{"source": _headline(first + k, 10), "target": _headline(100 + first + k, n)}
                for k, n in enumerate(sizes)]

    data = _write(tmp_path, {"train": rows(0, [3, 5]), "validation": rows(10, [2, 4, 3]), "test": rows(20, [12, 14])})
    task = _task("seq2seq_lm", data, minilm_dir)
    train, valid, test, collate = task.train_valid_test_datasets_provider()

    class RecordingBart(transformers.BartForConditionalGeneration):
        """A real tiny BART that notes how many tokens each generate() call was asked for and produced."""

        calls: list = []

        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            self.calls.append((kwargs["max_new_tokens"], out.shape[1] - 1))  # [0]: the decoder start
            return out

    tok = tokenizer
    config = transformers.BartConfig(vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id, d_model=32,
                                     encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     max_position_embeddings=64, bos_token_id=tok.cls_token_id,
                                     eos_token_id=tok.sep_token_id, decoder_start_token_id=tok.sep_token_id,
                                     forced_eos_token_id=None)
    torch.manual_seed(0)
    model = RecordingBart(config).eval()
    lengths = []
    for split, prepared in (("validation", valid), ("test", test)):
        targets = [json.loads(line)["target"] for line in open(os.path.join(data, f"{split}.jsonl"))]
        longest = max(len(tok(text_target=t, truncation=True, max_length=SEQ_LENGTH)["input_ids"]) for t in targets)
        RecordingBart.calls = []
        with torch.no_grad():
            out = task.metrics(model, task.build_data_loader(prepared, collate_fn=collate))
        assert "overlap_f1" in out
        batches = -(-len(targets) // 2)
        assert RecordingBart.calls == [(longest, longest)] * batches, (split, longest, RecordingBart.calls)
        lengths.append(longest)
    assert lengths[0] < lengths[1]  # the splits' lengths differ: generating the wrong one's shows
