"""The `rapidformer` command line: flags (arguments.py), the front end's rules (rules.py), launching the
workers (launch.py), and what each worker runs (worker.py: a --user-script, or a task's black-box Finetuner).
pretrain.py is the `main` of the engine's entry points (pretrain_megatron_gpt.py, pretrain_megatron_bert.py)."""
