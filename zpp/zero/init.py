"""``zpp.zero.Init``: build a model already partitioned, so that no rank ever holds it whole.

    with zpp.zero.Init():
        model = MyBigModel()          # each module partitioned as soon as it is built
    engine, *_ = zpp.initialize(model=model, config=ds_config)   # ZeRO stage 3

As DeepSpeed's ``deepspeed.zero.Init``. Collective: every rank builds the same modules in
the same order.

[Note: partitioned construction]
* Inside the context, the ``__init__`` of every ``nn.Module`` class (those defined before
  and inside it) is wrapped: when the outermost ``__init__`` of a module returns, each of
  its parameters not yet partitioned is flattened, padded to a multiple of the world size,
  and cut into equal slices; this rank keeps its slice (a *loose shard*) and the
  parameter's data becomes empty (its reads are intercepted: [Note: parameter access]). The
  peak memory of construction is the shards plus the largest module's own parameters,
  not the model.
* Each element is initialized by the one rank that keeps it, with that rank's random
  stream: the model is a valid random initialization whether or not the ranks are seeded
  alike (nothing is broadcast).
* A read of a loose parameter inside the context (an initialization after the module was
  built, ``model.apply(init_fn)``, a ``post_init``) gathers it (one all-gather of the
  slices) for that one torch function (``nn.init.normal_(p)``), then partitions it again
  with its new values; so at most one parameter is whole at a time. Through ``p.data``
  (whose later use cannot be seen) it stays gathered until the outermost module under
  construction is built. Outside the context, a read raises a ``RuntimeError`` naming the
  parameter: give the model to :func:`zpp.initialize`, or read it inside
  :class:`zpp.zero.GatheredParameters`. ``detach`` alone reads nothing and returns the empty
  placeholder, as DeepSpeed's does: ``model.state_dict()`` lists the keys (transformers'
  ``from_pretrained`` does so before loading the weights into the partitioned model).
* :func:`zpp.initialize` builds its units from the loose shards one parameter at a time
  (each parameter's slices are all-gathered and the unit keeps its own range), so the
  whole model is never materialized there either.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero import access, param_attrs


@dataclasses.dataclass(slots=True)
class LooseShard:
    """This rank's slice of a parameter built under :class:`Init`."""

    shard: torch.Tensor
    """``ceil(numel / world) `` elements of the flattened, zero-padded parameter."""
    shape: torch.Size
    numel: int
    world: Transport
    gathered: bool = False
    """The full data is attached right now (a read inside the context)."""


_LOOSE: dict[int, LooseShard] = {}
_STATE = threading.local()


class InitOwner(access.AccessOwner):
    """Reads of loose parameters (see [Note: partitioned construction])."""

    def on_access(self, param: torch.nn.Parameter, what: str, kind: str):
        active = getattr(_STATE, "init", None)
        if active is not None:
            gather_loose(param)
            if kind == "data":  # a tensor of the values, written through later: until the module is built
                active.regather.append(param)
                return None
            return lambda: repartition_loose(param, "own")  # the function has run: partition it again
        if kind == "shape" or what == "detach":  # state_dict(): the placeholder, as DeepSpeed's
            return None
        raise RuntimeError(
            f"zpp: a parameter of shape {tuple(_LOOSE[id(param)].shape)} was built under zpp.zero.Init and is "
            f"partitioned; it was read by {what} outside the Init context. Pass the model to zpp.initialize, "
            "or read it inside `with zpp.zero.GatheredParameters([param]):`")


_OWNER = InitOwner()


def is_loose(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is partitioned by :class:`Init` and not yet held by an engine."""
    return id(p) in _LOOSE


def shape_of(p: torch.nn.Parameter) -> torch.Size:
    """The shape of ``p``, also while it is a loose shard (whose data is empty)."""
    ls = _LOOSE.get(id(p))
    return ls.shape if ls is not None else p.shape


def numel_of(p: torch.nn.Parameter) -> int:
    ls = _LOOSE.get(id(p))
    return ls.numel if ls is not None else p.numel()


def partition(p: torch.nn.Parameter, world: Transport) -> None:
    """Keep this rank's slice of ``p``; its data becomes empty."""
    if id(p) in _LOOSE:
        return
    W, r = world.world_size, world.rank
    flat = p.detach().reshape(-1)
    per = -(-flat.numel() // W) if flat.numel() else 0
    shard = torch.zeros(per, dtype=p.dtype, device=p.device)
    lo, hi = min(r * per, flat.numel()), min((r + 1) * per, flat.numel())
    shard[:hi - lo] = flat[lo:hi]
    _LOOSE[id(p)] = LooseShard(shard, p.shape, flat.numel(), world)
    weakref.finalize(p, _LOOSE.pop, id(p), None)  # ids are reused once p is gone
    param_attrs.describe(p, numel=flat.numel(), shape=p.shape, partition=shard, persist=False,
                         status=param_attrs.ZeroParamStatus.NOT_AVAILABLE, padding=per - (hi - lo))
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    access.register([p], _OWNER)
    access.mark_sharded([p])


def full_value(p: torch.nn.Parameter) -> torch.Tensor:
    """All-gather a loose parameter's slices: a new tensor of its shape (collective)."""
    ls = _LOOSE[id(p)]
    W, per = ls.world.world_size, ls.shard.numel()
    out = torch.empty(W * per, dtype=ls.shard.dtype, device=ls.shard.device)
    if W > 1:
        ls.world.all_gather(out, ls.shard)
    else:
        out.copy_(ls.shard)
    return out[:ls.numel].view(ls.shape)


def gather_loose(p: torch.nn.Parameter) -> None:
    """Attach the full data of a loose parameter (collective)."""
    ls = _LOOSE[id(p)]
    if ls.gathered:
        return
    p.data = full_value(p)
    access.mark_gathered([p])
    ls.gathered = True


def repartition_loose(p: torch.nn.Parameter, source: int | str | None) -> None:
    """Partition a gathered loose parameter again, from its current values: this rank's own
    (``source="own"``, no communication: each element keeps the value of the rank that
    owns it), rank ``source``'s (broadcast first), or not at all (None: the slices it had
    before it was gathered)."""
    ls = _LOOSE[id(p)]
    if not ls.gathered:
        return
    if source is not None:
        full = p.data.contiguous().reshape(-1)
        if source != "own" and ls.world.world_size > 1:
            ls.world.broadcast(full, source)
        per, r = ls.shard.numel(), ls.world.rank
        lo, hi = min(r * per, ls.numel), min((r + 1) * per, ls.numel)
        ls.shard.zero_()
        ls.shard[:hi - lo] = full[lo:hi]
    p.data = torch.empty(0, dtype=ls.shard.dtype, device=ls.shard.device)
    access.mark_sharded([p])
    ls.gathered = False


def take(p: torch.nn.Parameter) -> LooseShard:
    """Hand a loose parameter over to an engine: it leaves the Init registry."""
    ls = _LOOSE.pop(id(p))
    access.unregister([p])
    return ls


def cast_loose(p: torch.nn.Parameter, dtype: torch.dtype) -> None:
    """Convert a loose parameter's shard (and its empty data) to ``dtype``."""
    ls = _LOOSE[id(p)]
    ls.shard = p.ds_tensor = ls.shard.to(dtype)
    p.data = torch.empty(0, dtype=dtype, device=ls.shard.device)


class Init:
    """Partition every module built inside the context; see [Note: partitioned construction].

    DeepSpeed's signature; the arguments zpp acts on:

    Args:
        module: an already built module to partition now (DeepSpeed's ``module=``).
        enabled: False makes the context a no-op (Default: True).
        dtype: cast floating parameters to this dtype before partitioning (Default: keep).
        transport: zpp's own: the world to partition over (Default:
            ``zpp.comm.get_transport()``, the world :func:`zpp.initialize` will use).

    ``data_parallel_group``, ``mpu``, ``zero_param_parallel_group`` and
    ``sequence_data_parallel_group`` (other process groups), ``remote_device="nvme"`` and
    ``param_swapper`` are refused with ``NotImplementedError``; ``mem_efficient_linear``,
    ``pin_memory``, ``remote_device`` "cpu"/None, ``config``/``config_dict_or_path`` and the
    quantization flags are accepted (nothing to do on a CPU job; the config is read at
    :func:`zpp.initialize`).
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None, *,
                 transport: Transport | None = None) -> None:
        del mem_efficient_linear, pin_memory, config_dict_or_path, config, zero_quantized_weights
        del zero_quantized_nontrainable_weights
        for name, v in (("data_parallel_group", data_parallel_group), ("mpu", mpu),
                        ("zero_param_parallel_group", zero_param_parallel_group),
                        ("sequence_data_parallel_group", sequence_data_parallel_group),
                        ("param_swapper", param_swapper)):
            if v is not None:
                raise NotImplementedError(f"zpp.zero.Init: {name}= is not implemented: zpp partitions over the "
                                          "one data-parallel world")
        if remote_device not in (None, "none", "cpu"):
            raise NotImplementedError(f"zpp.zero.Init: remote_device={remote_device!r} is not implemented "
                                      "(None or 'cpu')")
        self.enabled = enabled
        self.dtype = dtype
        self._world = transport
        self.regather: list[torch.nn.Parameter] = []
        self._wrapped: dict[type, Any] = {}
        self._depth: dict[int, int] = {}
        if module is not None and enabled:
            self._partition_tree(module)

    @property
    def world(self) -> Transport:
        if self._world is None:
            from zpp.comm.registry import get_transport

            self._world = get_transport()
        return self._world

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if getattr(_STATE, "init", None) is not None:
            raise RuntimeError("zpp.zero.Init: contexts do not nest")
        _ = self.world  # the transport now: DeepSpeed's Init initializes distributed on entering
        _STATE.init = self
        for cls in _all_module_classes():
            self._wrap(cls)
        self._old_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            self._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        try:
            self._settle()
        finally:
            for cls, original in self._wrapped.items():
                cls.__init__ = original
            self._wrapped.clear()
            if self._old_init_subclass is None:
                del torch.nn.Module.__init_subclass__
            else:
                torch.nn.Module.__init_subclass__ = self._old_init_subclass
            _STATE.init = None

    def _wrap(self, cls: type) -> None:
        if cls in self._wrapped or "__init__" not in cls.__dict__:
            return
        original = cls.__dict__["__init__"]
        init = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            key = id(module)
            init._depth[key] = init._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                init._depth[key] -= 1
            if init._depth[key] == 0:  # the most derived __init__ returned
                del init._depth[key]
                init._partition_tree(module)
                if not init._depth:  # no enclosing construction: settle what was read
                    init._settle()

        self._wrapped[cls] = original
        cls.__init__ = wrapped

    def _partition_tree(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype and not is_loose(p):
                p.data = p.data.to(self.dtype)
            partition(p, self.world)

    def _settle(self) -> None:
        """Partition again what reads inside the context gathered."""
        pending, self.regather = self.regather, []
        for p in pending:
            if is_loose(p):
                repartition_loose(p, "own")


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's: gather ``parameter`` with ``module``, which uses it without owning it.
    Nothing to do in zpp, which sees every read of a partitioned parameter and gathers it
    (see [Note: parameter access] in :mod:`zpp.zero.access`)."""
    del module, parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's counterpart of :func:`register_external_parameter`; nothing to do in zpp."""
    del module, parameter


def _all_module_classes() -> list[type]:
    out, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(cls.__subclasses__())
    return out
