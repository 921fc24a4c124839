"""The tune plan in the engine: the code width of each qwZ gather and qgZ reduction.

    lines = apply_plan(plan, units=engine.units, gathers=comms.gathers, reduce=comms.reduce,
                       config=train_config, world=world)   # at initialize; rank 0 logs lines

[Note: the plan in the engine]
A plan written by ``zpp tune`` (:mod:`zpp.comm.plan`) names, per collective and message
size, the fastest compression whose measured error stayed within its ``max_error``.
:func:`zpp.initialize` takes the plan of ``zpp.tune_plan``, else of ``$ZPP_TUNE_FILE``, and
applies it where the engine compresses:

* the switches decide *whether* a collective may be compressed: ``zero_quantized_weights``
  (the forward gathers, qwZ) and ``zero_quantized_gradients`` (the gradient
  reduce-scatters, qgZ). Without them the engine sends full precision and rank 0 says what
  the plan would have compressed;
* the plan decides *how*, for each message size the engine sends (a unit's full buffer for a
  gather, its fp32 gradient for a reduce-scatter; see :mod:`zpp.comm.plan` for how sizes are
  counted): ``int8`` -> 8 bits, ``int4`` -> 4 bits, ``none`` -> that unit's collective runs
  plain. The entries of the transport's own backend are used where the plan measured it;
  rank 0 logs the bits taken and why (the plan's bound, what it excluded);
* ``zpp.weight_bits`` / ``zpp.gradient_bits`` left unset (None) follow the plan; set, they
  must agree with every compressed size's choice, else :func:`apply_plan` raises a
  ``ValueError`` naming the key, its value, the plan's choice and the sizes (on every rank:
  the plan, the config and the units are the same everywhere, which the config agreement of
  :mod:`zpp.zero.agreement` checks for ``zpp.tune_plan``);
* a plan made for another world (size or ranks per node) is refused by
  :func:`check_plan_world` with a ``ValueError`` naming both: its choices were measured on
  other links;
* under ``zpp.outer`` the ZeRO collectives run inside one node, which a plan measured over
  the whole world does not describe: the bits stay as configured, and rank 0 warns.

Without a plan nothing changes: 8-bit weights and 4-bit gradients, or the configured bits.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from zpp.comm.plan import TunePlan
from zpp.zero.config import DEFAULT_GRADIENT_BITS, DEFAULT_WEIGHT_BITS, TrainConfig
from zpp.zero.gather import QuantizedGather, SecondaryGather
from zpp.zero.reduce import QuantizedReduceScatter

if TYPE_CHECKING:
    from zpp.comm.transport import Transport
    from zpp.zero.comm_api import GradReduce, WeightGather
    from zpp.zero.unit import Unit

__all__ = ["BITS", "apply_plan", "check_plan_world", "plan_bits", "ranks_per_node"]

#: A plan's compression -> the code width (None: the plain collective).
BITS: dict[str, int | None] = {"none": None, "int8": 8, "int4": 4}


class _Use:
    """What one engine collective is, for messages: the plan's op, the config key, the switch."""

    def __init__(self, op: str, what: str, key: str, switch: str, default: int, group_key: str) -> None:
        self.op, self.what, self.key, self.switch, self.default, self.group_key = (
            op, what, key, switch, default, group_key)


_GATHER = _Use("all_gather", "qwZ weight gathers", "weight_bits", "zero_quantized_weights", DEFAULT_WEIGHT_BITS,
               "weight_group_size")
_REDUCE = _Use("reduce_scatter", "qgZ gradient reduce-scatters", "gradient_bits", "zero_quantized_gradients",
               DEFAULT_GRADIENT_BITS, "gradient_group_size")


def ranks_per_node(world: Transport) -> int:
    """The ranks per node of ``world`` from its node numbering (no collective)."""
    nodes = len(set(world.nodes)) or 1
    return world.world_size // nodes


def check_plan_world(plan: TunePlan, world: Transport) -> None:
    """ValueError naming both worlds unless ``plan`` was made for ``world``'s size and ranks
    per node (see [Note: the plan in the engine])."""
    plan.check_world(world.world_size, ranks_per_node(world),
                     what=f"this job's {getattr(world, 'name', 'world')} transport")


def plan_bits(plan: TunePlan, op: str, sizes: Iterable[int], *, backend: str, key: str,
              explicit: int | None) -> dict[int, int | None]:
    """Message bytes -> code width (None: plain) that ``plan`` chooses for ``op`` on
    ``backend`` at each of ``sizes``; KeyError when the plan has no ``op`` entries.
    ``explicit``: the configured width (``zpp.<key>``), None when unset; a compressed size
    where the plan chooses another width raises ValueError naming both."""
    chosen = {n: plan.choose(op, n, backend=backend).compress for n in sorted(set(sizes))}
    if explicit is not None:
        against = {n: c for n, c in chosen.items() if BITS[c] is not None and BITS[c] != explicit}
        if against:
            n, c = next(iter(against.items()))
            more = f" (and {len(against) - 1} more sizes)" if len(against) > 1 else ""
            raise ValueError(
                f"zpp.initialize: zpp.{key}={explicit} contradicts the tune plan {plan.source}: it chooses "
                f"{c} ({BITS[c]} bits) for {op} of {n} bytes{more}, within its max_error {plan.max_error:g} on "
                f"{backend}. Remove zpp.{key} to follow the plan, or run without the plan (unset "
                f"zpp.tune_plan and $ZPP_TUNE_FILE)")
    return {n: BITS[c] for n, c in chosen.items()}


def _span(sizes: Iterable[int]) -> str:
    sizes = sorted(sizes)
    return f"{sizes[0]} bytes" if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]} bytes"


def _excluded(plan: TunePlan, op: str, backend: str) -> str:
    """What the plan's ``meta.excluded`` says it left out for ``op`` on ``backend``."""
    out = []
    for x in plan.meta.get("excluded", ()) or ():
        if not isinstance(x, Mapping) or x.get("op") != op or x.get("backend") not in (backend, None):
            continue
        if x.get("reason") in (None, "not tunable"):
            continue
        err = x.get("maxrelerr")
        worst = f", worst maxrelerr {err:.3g}" if isinstance(err, (int, float)) else ""
        out.append(f"{x.get('compress')} ({x['reason']}{worst})")
    return f"; it excluded {', '.join(out)}" if out else ""


def _describe(plan: TunePlan, use: _Use, bits: Mapping[int, int | None], units: Counter, config: TrainConfig,
              backend: str) -> str:
    by_width: dict[int | None, list[int]] = {}
    for n, b in bits.items():
        by_width.setdefault(b, []).append(n)
    parts = []
    for b in sorted(by_width, key=lambda b: -1 if b is None else b, reverse=True):
        k = sum(units[n] for n in by_width[b])
        parts.append(f"{'plain' if b is None else f'{b} bits'} for {k} unit{'s' * (k != 1)} "
                     f"({_span(by_width[b])} per call)")
    explicit = getattr(config.zpp, use.key)
    given = (f"zpp.{use.key}={explicit} agrees" if explicit is not None
             else f"zpp.{use.key} is unset (without a plan: {use.default})")
    group = getattr(config.zpp, use.group_key)
    group_note = ""
    if group != plan.group_size:  # a finer group's scale is at most the coarser one's: its error bound too
        group_note = (f"; the plan measured groups of {plan.group_size}, zpp.{use.group_key} is {group}, so "
                      + ("its errors bound these finer groups' from above" if group < plan.group_size
                         else "these coarser groups may err more than it measured"))
    where = (f"on {backend}" if backend in plan.by_backend
             else f"overall (the plan has no entries of its own for {backend or 'this transport'})")
    return (f"zpp.initialize: {use.what} follow the tune plan {plan.source}: {'; '.join(parts)}: its fastest "
            f"{use.op} {where} within max_error {plan.max_error:g}{_excluded(plan, use.op, backend)}; "
            f"{given}{group_note}")


def _quantized_gather(gathers: Mapping[Any, WeightGather]) -> QuantizedGather | None:
    for g in gathers.values():
        while isinstance(g, SecondaryGather):
            g = g.inner
        if isinstance(g, QuantizedGather):
            return g
    return None


def apply_plan(plan: TunePlan, *, units: Iterable[Unit], gathers: Mapping[Any, WeightGather], reduce: GradReduce,
               config: TrainConfig, world: Transport) -> list[tuple[str, str]]:
    """Set the code width per message size of the engine's qwZ gather and qgZ reduction from
    ``plan`` (see [Note: the plan in the engine]); ValueError when a configured width
    contradicts it. Returns ``(level, message)`` pairs for rank 0 to log ("info" or
    "warning")."""
    if config.zpp.outer is not None:
        return [("warning", f"zpp.initialize: the tune plan {plan.source} is not applied to the ZeRO collectives: "
                            "under zpp.outer they run inside one node, which a plan measured over the whole world "
                            "does not describe; zpp.weight_bits / gradient_bits stay as configured")]
    units = list(units)
    backend = getattr(world, "name", "")
    sizes = {
        _GATHER: Counter(u.layout.padded_numel * u.flat.dtype.itemsize for u in units if u.shards_params),
        _REDUCE: Counter(u.layout.padded_numel * 4 for u in units if u.trainable),
    }
    strategies = {_GATHER: _quantized_gather(gathers),
                  _REDUCE: reduce if isinstance(reduce, QuantizedReduceScatter) else None}
    lines: list[tuple[str, str]] = []
    for use, strategy in strategies.items():
        if not sizes[use]:
            continue
        if strategy is None:
            if use is _GATHER or any(u.shards_params for u in units):  # the switch is available (stage 3)
                lines += _unused(plan, use, sizes[use], backend)
            continue
        try:
            bits = plan_bits(plan, use.op, sizes[use], backend=backend, key=use.key,
                             explicit=getattr(config.zpp, use.key))
        except KeyError:
            lines.append(("info", f"zpp.initialize: the tune plan {plan.source} has no {use.op} entries; {use.what} "
                                  f"keep {strategy.bits} bits"))
            continue
        strategy.by_nbytes = bits
        lines.append(("info", _describe(plan, use, bits, sizes[use], config, backend)))
    return lines


def _unused(plan: TunePlan, use: _Use, sizes: Counter, backend: str) -> list[tuple[str, str]]:
    """The plan would compress some of these sizes, but the switch is off: say so."""
    try:
        chosen = {n: plan.choose(use.op, n, backend=backend).compress for n in sizes}
    except KeyError:
        return []
    packed = sorted({c for c in chosen.values() if c != "none"})
    if not packed:
        return []
    k = sum(sizes[n] for n, c in chosen.items() if c != "none")
    return [("info", f"zpp.initialize: the tune plan {plan.source} chooses {'/'.join(packed)} for {k} of this "
                     f"engine's {use.op} sizes, but {use.switch} is off, so they run in full precision; set "
                     f"zero_optimization.{use.switch} to follow the plan")]
