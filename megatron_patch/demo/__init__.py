"""Generated data for the demo and the tests, kept out of the library core: `corpus` (the demo pretraining
corpus, Python's standard-library docstrings as JSONL) and `task_corpora` (small fine-tuning datasets for every
`--task`, made from the same text). Nothing in the library imports them."""
