"""``split_params_into_different_moe_groups_for_optimizer`` with DeepSpeed's signature.

zpp has no MoE layers and no expert parallelism, so no parameter is an expert parameter:
every group passes through unchanged (as DeepSpeed returns them for a model without MoE
layers). A parameter that an MoE layer of another library marked as an expert
(``param.allreduce is False``, DeepSpeed's mark) raises ``NotImplementedError``: zpp would
average its gradient over every rank, which is not what an expert-parallel layer means.
"""
from __future__ import annotations

from typing import Any

__all__ = ["is_moe_param", "is_moe_param_group", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: Any) -> bool:
    """DeepSpeed's mark of an expert parameter: an ``allreduce`` attribute that is False."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: int | float | None = 178956971) -> list[dict[str, Any]]:
    """The parameter groups as a list (a single dict becomes a one-element list), each group
    unchanged: zpp has no MoE layers, so there are no expert parameters to split off.

    Args:
        param_groups: a parameter group (a dict with "params"), or a list or tuple of them.
        max_group_size: DeepSpeed's cap on an expert group's elements; unused without experts.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"parameter group {i} must be a dict with 'params', got {group!r:.80}")
        params = group["params"]
        if hasattr(params, "data_ptr"):  # one tensor, as torch optimizers accept
            params = [params]
        elif not isinstance(params, (list, tuple)):  # a generator would be used up by the check
            group["params"] = params = list(params)
        experts = [p for p in params if is_moe_param(p)]
        if experts:
            raise NotImplementedError(
                f"parameter group {i} ({group.get('name', 'unnamed')!r}) holds {len(experts)} expert parameters "
                "(allreduce=False): zpp has no expert parallelism and would average their gradients over "
                "every rank")
    return param_groups
