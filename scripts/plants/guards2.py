"""Plants for the black-box fine-tuning guards of issue 27 part 1 (token labels on the first piece, answer spans,
per-epoch reshuffle, per-split generation length): each breaks one property; the listed default-lane tests
must fail."""
PLANTS = [
    dict(name="token-label-on-last-piece", file="megatron_patch/cli/tasks/token_classification.py",
         original="                previous, row = None, []\n"
                  "                for w in out.word_ids(i):\n"
                  "                    # the first piece of each word carries its tag; other pieces and special tokens are ignored\n"
                  "                    row.append(-100 if w is None or w == previous else sample_tags[w])\n"
                  "                    previous = w\n"
                  "                out[\"labels\"].append(row)\n",
         replacement="                previous, row = None, []\n"
                     "                for w in reversed(out.word_ids(i)):\n"
                     "                    row.append(-100 if w is None or w == previous else sample_tags[w])\n"
                     "                    previous = w\n"
                     "                out[\"labels\"].append(row[::-1])\n",
         property="token_classification: a word's tag is on its first sub-word piece, the others -100",
         tests=["tests/test_task_alignment.py::test_token_labels_on_the_first_piece_of_each_word"]),
    dict(name="token-f1-reads-the-next-piece", file="megatron_patch/cli/tasks/token_classification.py",
         original="                keep = [(a, b) for a, b in zip(p, g) if b != -100]\n",
         replacement="                keep = [(a, b) for a, b in zip(p[1:], g) if b != -100]\n",
         property="token_classification: the entity F1 reads the prediction of each word's first piece",
         tests=["tests/test_task_alignment.py::test_entity_f1_reads_each_words_first_piece"]),
    dict(name="qa-end-position-off-by-one", file="megatron_patch/cli/tasks/question_answering.py",
         original="                    start, end = inside[0], inside[-1]\n",
         replacement="                    start, end = inside[0], inside[-1] + 1\n",
         property="question_answering: the training end position is the answer's last token (inclusive)",
         tests=["tests/test_task_alignment.py::test_answer_positions_from_the_character_span"]),
    dict(name="qa-partial-answer-at-window-end", file="megatron_patch/cli/tasks/question_answering.py",
         original="                if inside and offsets[inside[0]][0] <= start_char and offsets[inside[-1]][1] >= end_char:\n",
         replacement="                if inside and offsets[inside[0]][0] <= start_char:\n",
         property="question_answering: an answer cut by the window's end trains on token 0, not on its visible part",
         tests=["tests/test_task_alignment.py::test_answer_positions_from_the_character_span"]),
    dict(name="qa-span-text-drops-last-token", file="megatron_patch/cli/tasks/question_answering.py",
         original="        return context[offsets[start][0]:offsets[end][1]]\n",
         replacement="        return context[offsets[start][0]:offsets[end][0]]\n",
         property="question_answering: the evaluated answer is cut from the context through its end token's last "
                  "character",
         tests=["tests/test_task_alignment.py::test_best_span_against_brute_force",
                "tests/test_task_alignment.py::test_answers_extracted_at_evaluation"]),
    dict(name="qa-answer-length-off-by-one", file="megatron_patch/cli/tasks/question_answering.py",
         original="        allowed = torch.ones(n, n, dtype=torch.bool).triu().tril(MAX_ANSWER_TOKENS - 1)\n",
         replacement="        allowed = torch.ones(n, n, dtype=torch.bool).triu().tril(MAX_ANSWER_TOKENS)\n",
         property="question_answering: evaluated spans are at most MAX_ANSWER_TOKENS (30) tokens",
         tests=["tests/test_task_alignment.py::test_best_span_against_brute_force"]),
    dict(name="finetuner-no-set-epoch", file="megatron_patch/templates/torch_loop.py",
         original="        if hasattr(self.loader.sampler, \"set_epoch\"):\n",
         replacement="        if hasattr(self.loader, \"set_epoch\"):\n",
         property="the Finetuner reshuffles the training data every epoch (the sampler's set_epoch)",
         tests=["tests/test_finetuner_loop.py -k new_order"]),
    dict(name="finetuner-train-drops-last-partial-batch", file="megatron_patch/templates/finetuner.py",
         original="        train_loader = self.build_data_loader(train_ds, shuffle=True, collate_fn=train_collate, drop_last=False)\n",
         replacement="        train_loader = self.build_data_loader(train_ds, shuffle=True, collate_fn=train_collate, drop_last=True)\n",
         property="each training epoch visits every training sample (the last partial batch too)",
         tests=["tests/test_finetuner_loop.py -k new_order"]),
    dict(name="seq2seq-generation-length-of-last-split", file="megatron_patch/cli/tasks/seq2seq.py",
         original="        new_tokens = self.new_tokens.get(id(loader.dataset), MAX_TARGET_LENGTH)\n",
         replacement="        new_tokens = list(self.new_tokens.values())[-1]\n",
         property="seq2seq_lm: each split is generated up to its own longest target (not the last prepared split's)",
         tests=["tests/test_task_alignment.py::test_each_split_generates_up_to_its_own_longest_target"]),
]
