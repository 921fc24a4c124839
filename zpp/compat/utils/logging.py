"""DeepSpeed's ``deepspeed.utils.logging``: zpp's logger (:mod:`zpp.log`) under DeepSpeed's
module name, for the scripts that import it from there."""
from zpp.log import (  # noqa: F401  (re-exported)
    RANK_VARS,
    get_log_level_from_string,
    log_dist,
    log_dist_once,
    log_levels,
    logger,
    process_rank,
    set_log_level_from_string,
    should_log_le,
)

__all__ = ["get_log_level_from_string", "log_dist", "log_dist_once", "logger", "set_log_level_from_string",
           "should_log_le"]
