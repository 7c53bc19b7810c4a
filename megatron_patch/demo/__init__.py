"""Generated data for the demo and the tests, kept out of the library core: `corpus` (the demo pretraining
corpus, Python's standard-library docstrings as JSONL), `task_corpora` (small fine-tuning datasets for every
`--task`, made from the same text: its tags in `task_tags`, a row's material in `task_units`, the files and
`tools/make_finetune_data.py` in `task_files`) and `package_text` (a 20M-token corpus for comparing training runs:
the docstrings, comments and documentation files of the installed packages; `tools/build_text_corpus.py`).
Nothing in the library imports them."""
