"""DeepSpeed's ``deepspeed.utils.z3_leaf_module``: the ZeRO-3 leaf-module flags of
:mod:`zpp.zero.leaf_modules` under DeepSpeed's module name."""
from zpp.zero.leaf_modules import (  # noqa: F401  (re-exported)
    DEFAULT_LEAF_MODULE_CLASSES,
    apply_leaf_module_config,
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "apply_leaf_module_config", "get_z3_leaf_modules", "set_z3_leaf_module",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
