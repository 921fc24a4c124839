"""The module and parameter hooks through which the engine follows forward and backward.

[Note: stage 3 hooks]
* Every module of the model gets a forward pre-hook and a forward hook (with sharded
  parameters). They keep the stack of running forwards, and for a module that needs units
  (planned, see [Note: stage 3 units] in :mod:`zpp.zero.planning`, or learned, below) the
  pre-hook gathers them for :attr:`Phase.FORWARD` and counts a forward user; the forward
  hook drops the user, releases at zero users (when the policy reshards after forward, and
  always without grad), and (with grad enabled) registers a hook on each output that
  requires grad. That hook runs when the output's gradient is ready, i.e. right before the
  module's own backward, and gathers its units for :attr:`Phase.BACKWARD` (a no-op for units
  still gathered). Activation checkpointing re-runs forwards inside backward; the same
  hooks gather again then.
* A sharded parameter read where no hook gathered it (see [Note: parameter access] in
  :mod:`zpp.zero.access`) is gathered on the spot: inside a forward, for the innermost
  running module, which from then on *needs* the unit (its pre-hook gathers it on later
  passes, so the read costs one extra gather once, and is logged once); inside backward,
  until the end of the backward. Outside both, the read raises ``RuntimeError`` naming the
  parameter.
* Gathers go through the engine's :class:`~zpp.zero.prefetch.Prefetcher`, which serves them
  from gathers it started ahead when the order follows the recorded trace (see
  [Note: stage 3 prefetch]); the root module's forward pre-hook opens a pass, the end of
  ``engine.backward`` (or of a forward without grad) closes it.
* ``register_post_accumulate_grad_hook`` on every trainable parameter (with sharded
  gradients) records that its gradient arrived; once every parameter of the unit has
  arrived, the unit reduces its flat gradient into its fp32 shard accumulator and releases
  the full buffer. A leaf's hook runs once per backward however often the parameter was
  used, so tied parameters are reduced once; but re-entrant activation checkpointing runs
  one backward per checkpointed segment, so a parameter used in two segments arrives twice:
  what arrives after its unit was reduced stays in ``.grad`` for the flush below (one more
  reduction, the same sum).
* ``engine.backward`` then flushes, in unit order, every unit that was not reduced (unused
  parameters count as zeros) or holds gradient that arrived after its reduction, and
  releases whatever is still gathered.
* At every stage the root's pre-hook checks that the model still holds exactly the
  parameters it was built with: a module created or swapped after initialize would train
  outside the engine, so it is refused.
Every rank must run the same graph, as with DDP: collectives are issued in hook order.

[Note: state_dict of a partitioned module]
``module.state_dict()`` detaches every parameter; at stage 3, outside a forward, a
partitioned parameter is an empty placeholder there. A read of its values raises (see
:meth:`EngineHooks.on_access`), but ``detach`` alone computes nothing: it passes, returning
the placeholder, as DeepSpeed's ZeRO-3 does, with one ``RuntimeWarning`` per engine.
Lightning's checkpointing builds such a state dict on every rank and drops it (the engine's
``save_checkpoint`` writes the shards); a user who saves it gets the warning, which names
``engine.consolidated_state_dict()``.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zpp.zero import access
from zpp.zero.comm_api import Phase
from zpp.zero.planning import UnitPlan
from zpp.zero.policy import ShardingPolicy
from zpp.zero.prefetch import Prefetcher
from zpp.zero.unit import Unit

log = logging.getLogger("zpp.zero")


class EngineHooks(access.AccessOwner):
    """The hooks of one engine and the state they share (needs, the forward stack).

    Args:
        module: the wrapped model.
        plan: its units and the planned needs.
        policy: what is sharded.
        prefetcher: the engine's prefetcher (stage 3).
    """

    def __init__(self, module: torch.nn.Module, plan: UnitPlan, *, policy: ShardingPolicy,
                 prefetcher: Prefetcher) -> None:
        self.module = module
        self.policy = policy
        self.prefetcher = prefetcher
        self.units = plan.units
        #: per module id: the units it has gathered while it runs (planned, then learned)
        self.needs: dict[int, list[Unit]] = {id(m): list(us) for m, us in plan.needs}
        self.unit_of = {id(p): u for u in plan.units for p in u.params}
        self.param_names: dict[int, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(p), n)
        self.module_names = {id(m): n or type(m).__name__ for n, m in module.named_modules()}
        self.known = frozenset(self.unit_of)
        #: (module name, unit index) of every need learned from a read outside the plan
        self.learned: list[tuple[str, int]] = []
        self.stack: list[torch.nn.Module] = []
        self.handles: list[RemovableHandle] = []
        #: ends the engine these hooks belong to (set by the engine; see [Note: a module
        #: initialized again] in :mod:`zpp.zero.engine`)
        self.close_engine: Callable[[], None] | None = None
        self.warned_placeholder = False

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        """Register every hook the policy needs (the handles are kept for :meth:`remove`)."""
        h = self.handles
        access.register([p for u in self.units for p in u.params], self)
        h.append(self.module.register_forward_pre_hook(self._begin))
        if self.policy.shard_parameters:
            for m in self.module.modules():
                h.append(m.register_forward_pre_hook(self._pre_forward))
                h.append(m.register_forward_hook(self._post_forward))
            h.append(self.module.register_forward_hook(self._end_forward))
        if self.policy.reduce_each_micro_step:
            for u in self.units:
                if u.trainable:
                    hook = _grad_ready(u)
                    h.extend(p.register_post_accumulate_grad_hook(hook) for p in u.params if p.requires_grad)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        access.unregister([p for u in self.units for p in u.params])

    # ------------------------------------------------------------------ forward
    def _begin(self, _module, _args) -> None:
        self._check_parameters()
        if not self.policy.shard_parameters:
            return
        if self.stack:  # a forward that raised: its units are still counted
            self.stack.clear()
            for u in self.units:
                if u.forward_users:
                    u.forward_users = 0
                    u.release()
        # the pass hooks run before / after the root's own: see [Note: stage 3 prefetch]
        self.prefetcher.begin_pass(torch.is_grad_enabled())

    def _end_forward(self, _m, _a, _out) -> None:
        if not torch.is_grad_enabled():
            self.prefetcher.end_pass()

    def _pre_forward(self, module: torch.nn.Module, _args) -> None:
        self.stack.append(module)
        for u in self.needs.get(id(module), ()):
            u.forward_users += 1
            self.prefetcher.gather(u, Phase.FORWARD)

    def _post_forward(self, module: torch.nn.Module, _args, output) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        units = self.needs.get(id(module))
        if not units:
            return
        grad = torch.is_grad_enabled()
        reshard = self.policy.reshard_after_forward or not grad
        for u in units:
            u.forward_users -= 1
            if u.forward_users == 0 and reshard:
                u.release()
        if grad:
            pre_backward = self._pre_backward(units)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(pre_backward)

    def _pre_backward(self, units: list[Unit]) -> Callable:
        def hook(_grad):
            for u in units:
                self.prefetcher.gather(u, Phase.BACKWARD)
        return hook

    # ------------------------------------------------------------------ reads outside the plan
    def on_access(self, param: torch.nn.Parameter, what: str, kind: str) -> None:
        u = self.unit_of[id(param)]
        if self.stack:
            module = self.stack[-1]
            needs = self.needs.setdefault(id(module), [])
            if u not in needs:
                needs.append(u)
                u.forward_users += 1  # this forward's user; its forward hook drops it
                name = self.module_names.get(id(module), type(module).__name__)
                self.learned.append((name, u.index))
                log.info("zpp stage 3: module %r reads %r (unit %d) outside that parameter's own forward (via %s); "
                         "it gathers unit %d before its forward from now on", name,
                         self.param_names.get(id(param)), u.index, what, u.index)
            self.prefetcher.gather(u, Phase.FORWARD)
        elif torch._C._current_graph_task_id() != -1:  # inside backward: released at its end
            self.prefetcher.gather(u, Phase.BACKWARD)
        elif what == "detach":  # see [Note: state_dict of a partitioned module]
            if not self.warned_placeholder:
                self.warned_placeholder = True
                warnings.warn(
                    f"zpp: state_dict() (or detach) of partitioned parameters outside forward, first "
                    f"{self.param_names.get(id(param), '?')!r}: it holds this rank's empty placeholder, as DeepSpeed's "
                    "ZeRO-3 gives; for the values use engine.consolidated_state_dict() or "
                    "zpp.zero.GatheredParameters", RuntimeWarning, stacklevel=3)
        elif kind != "shape":
            raise RuntimeError(
                f"zpp: parameter {self.param_names.get(id(param), '?')!r} is partitioned (ZeRO stage 3) and was "
                f"read by {what} outside the model's forward and backward, where this rank holds only its "
                f"shard. Read it inside a forward, wrap the read in `with zpp.zero.GatheredParameters([param]):`, "
                "or use engine.consolidated_state_dict() for the full weights")

    def _check_parameters(self) -> None:
        now = {id(p): n for n, p in self.module.named_parameters()}
        if now.keys() != self.known:
            new = [n for i, n in now.items() if i not in self.known]
            gone = sorted(self.param_names[i] for i in self.known - now.keys())
            raise RuntimeError(
                f"zpp: the model's parameters changed after initialize (new: {new[:5]}, gone: {gone[:5]}); "
                "modules created or swapped after zpp.initialize are not trained by the engine. Build the "
                "whole model first, then call zpp.initialize")


def _grad_ready(unit: Unit) -> Callable:
    def hook(param):
        unit.arrived.add(id(param))
        if len(unit.arrived) == unit.expected_grads and not unit.reduced:
            unit.reduce_grads()
            unit.release()
    return hook
