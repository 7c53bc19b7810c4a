"""Process groups (megatron-core's parallel_state, exposed as `mpu`), launch from the torchrun
environment. (The CPU backend that lets megatron-core run without a GPU lives in megatron_patch.compat.)
`start_process_group` is the set-up every run shares; megatron-core is imported only once a run needs it (`mpu`,
`initialize`), so the torch loop's Hugging Face runs never import it."""
from .initialize import current_device, destroy, initialize, is_last_rank, print_rank_0, start_process_group

__all__ = ["mpu", "current_device", "initialize", "destroy", "print_rank_0", "is_last_rank", "start_process_group"]


def __getattr__(name: str):
    if name == "mpu":
        from megatron.core import parallel_state

        return parallel_state
    raise AttributeError(name)
