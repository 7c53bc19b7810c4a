"""Generated data for the demo and the tests, kept out of the library core: `corpus` (the demo pretraining
corpus, Python's standard-library docstrings as JSONL) and `task_corpora` (small fine-tuning datasets for every
`--task`, made from the same text: its tags in `task_tags`, a row's material in `task_units`, the files and
`tools/make_finetune_data.py` in `task_files`). Nothing in the library imports them."""
