"""White-box templates: RapidformerEngine (process group, device, compose), Finetuner (four hooks), and the
globals the documented samples use (get_args, get_logger, get_timers)."""
from .engine import RapidformerEngine
from .finetuner import Finetuner
from .globals import get_args, get_logger, get_timers

__all__ = ["RapidformerEngine", "Finetuner", "get_args", "get_logger", "get_timers"]
