"""The pretraining loop on megatron-core: schedules, optimizer, lr schedule, checkpoints, logging."""
