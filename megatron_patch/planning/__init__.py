"""The parallel-layout planner: which TP/PP/VPP/DP/EP/ZeRO layout, micro batch and recompute for a model on N GPUs,
ranked by predicted step time, with the predicted memory of each rank (`tools/plan_parallel.py`)."""
