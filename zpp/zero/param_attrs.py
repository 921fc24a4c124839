"""DeepSpeed's ZeRO-3 parameter attributes (``ds_numel``, ``ds_shape``, ``ds_status``...).

Libraries that support DeepSpeed's ZeRO-3 read these on a partitioned parameter, whose own
``shape`` and ``numel()`` describe an empty placeholder: the Hugging Face Trainer counts
parameters with ``p.ds_numel``, Lightning's model summary with ``ds_numel`` and
``partition_numel()``, PEFT and user code test ``ds_status`` before reading values.

[Note: ZeRO-3 parameter attributes]
Every parameter partitioned by :class:`zpp.zero.Init` or held by a stage-3 engine carries

* ``ds_numel`` / ``ds_shape``: the full parameter's element count and shape;
* ``ds_tensor``: this rank's partition of it, a tensor in the parameter's dtype. Under
  ``Init`` it is the parameter's own slice (``ceil(numel / world)`` elements, zero-padded,
  as DeepSpeed's). In an engine it is the view of the unit's flat shard that covers this
  parameter: zpp shards a whole unit (a block) at once, so a parameter's elements may lie
  on one rank only, and ``ds_tensor`` then has between 0 and ``ds_numel`` elements on each
  rank (the sizes sum to ``ds_numel`` over the ranks). ``partition_numel()`` is its size;
* ``ds_status``: :class:`ZeroParamStatus`, kept current by every gather and release
  (``AVAILABLE`` while the full values are attached, ``INFLIGHT`` while a started gather
  runs, ``NOT_AVAILABLE`` otherwise);
* ``ds_id``: a number unique in the process, given in construction order and kept for the
  parameter's life; ``ds_persist``: the parameter stays whole between uses (below
  ``stage3_param_persistence_threshold``); ``ds_active_sub_modules``: an empty set (zpp
  counts users per unit, not per parameter);
* ``all_gather()`` / ``partition()``: a read-only :class:`~zpp.zero.GatheredParameters`
  block split in two calls (collective): the parameter (in an engine, its unit) is whole from
  ``all_gather()`` to ``partition()``, which drops what changed meanwhile, as DeepSpeed's
  does by default; ``has_been_updated=True`` and ``free_data=False`` are refused (a change
  to keep is made inside ``GatheredParameters(params, modifier_rank=r)``).

The values are plain attributes written at the transitions (a pointer store per
parameter per gather, like the class swap of [Note: parameter access]); they describe the
state and never drive it.
"""
from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable, Iterable

import torch

__all__ = ["ZeroParamStatus", "ZeroParamType", "describe", "set_status"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``."""

    AVAILABLE = 1
    """The full values are attached on every rank."""
    NOT_AVAILABLE = 2
    """Partitioned: the parameter's data is an empty placeholder."""
    INFLIGHT = 3
    """A gather is running."""


class ZeroParamType(enum.Enum):
    """DeepSpeed's ``ZeroParamType`` (zpp's partitioned parameters are all ``PARTITIONED``)."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


_IDS = itertools.count()


def describe(p: torch.nn.Parameter, *, numel: int, shape: torch.Size, partition: torch.Tensor,
             persist: bool, status: ZeroParamStatus, padding: int = 0) -> None:
    """Write the attributes of [Note: ZeRO-3 parameter attributes] on ``p``; ``padding``:
    the zero elements at the end of ``partition`` (past the parameter's last element)."""
    p.ds_numel = numel
    p.ds_shape = torch.Size(shape)
    p.ds_tensor = partition
    p.ds_persist = persist
    p.ds_status = status
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_IDS)
    p.ds_param_type = ZeroParamType.PARTITIONED
    p.ds_active_sub_modules = set()
    p.partition_numel = _method(p, lambda q, n=partition.numel(): n)
    p.padding_size = _method(p, lambda q: padding)
    p.ds_summary = _method(p, _summary)
    p.all_gather = _method(p, _all_gather)
    p.partition = _method(p, _partition)


def set_on_disk(params, on_disk: bool) -> None:
    """The unit's shard went to the NVMe tier (``on_disk``) or came back: meanwhile each
    ``ds_tensor`` is an empty tensor, since the partition's storage is freed and reading it
    would read freed memory (see [Note: parameters on NVMe] in :mod:`zpp.zero.param_swap`)."""
    for p in params:
        if on_disk and hasattr(p, "ds_tensor") and "_zpp_partition" not in p.__dict__:
            p._zpp_partition = p.ds_tensor
            p.ds_tensor = p.ds_tensor.new_empty(0)
        elif not on_disk and "_zpp_partition" in p.__dict__:
            p.ds_tensor = p.__dict__.pop("_zpp_partition")


def _all_gather(p: torch.nn.Parameter, param_list=None, async_op: bool = False, hierarchy: int = 0) -> None:
    from zpp.zero.gathered import GatheredParameters

    if param_list is not None and any(q is not p for q in param_list):
        raise NotImplementedError("param.all_gather(param_list=...): gather several parameters with "
                                  "zpp.zero.GatheredParameters(params)")
    if "_zpp_gathered" not in p.__dict__:
        block = GatheredParameters([p], modifier_rank=None)
        block.__enter__()
        p._zpp_gathered = block


def _partition(p: torch.nn.Parameter, param_list=None, hierarchy: int = 0, has_been_updated: bool = False,
               free_data: bool = True) -> None:
    if has_been_updated or not free_data:
        raise NotImplementedError(
            f"param.partition(has_been_updated={has_been_updated}, free_data={free_data}): zpp drops the gathered "
            "values at partition(); to keep a change, make it inside zpp.zero.GatheredParameters(params, "
            "modifier_rank=r)")
    block = p.__dict__.pop("_zpp_gathered", None)
    if block is not None:
        block.__exit__(None, None, None)


def _method(p: torch.nn.Parameter, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` bound to ``p`` without a reference cycle (the parameter stays collectable)."""
    ref = weakref.ref(p)
    return lambda *args, **kwargs: fn(ref(), *args, **kwargs)


def set_status(params: Iterable[torch.nn.Parameter], status: ZeroParamStatus) -> None:
    """Record a transition on the parameters that carry the attributes."""
    for p in params:
        if "ds_status" in p.__dict__:
            p.ds_status = status


def _summary(p: torch.nn.Parameter) -> dict:
    return {"id": p.ds_id, "status": p.ds_status.name, "numel": p.numel(), "ds_numel": p.ds_numel,
            "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape), "requires_grad": p.requires_grad,
            "persist": p.ds_persist, "partition_numel": p.partition_numel()}
