"""DeepSpeed's ``deepspeed.utils`` names that scripts import: the logger and ``log_dist``."""
from zpp.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string

__all__ = ["log_dist", "log_dist_once", "logger", "set_log_level_from_string"]
