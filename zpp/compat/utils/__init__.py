"""DeepSpeed's ``deepspeed.utils`` names that scripts import: the logger, ``log_dist`` and
the ZeRO-3 leaf-module flags (:mod:`zpp.utils.z3_leaf_module`)."""
from zpp.compat.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from zpp.compat.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = ["get_z3_leaf_modules", "log_dist", "log_dist_once", "logger", "set_log_level_from_string",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
