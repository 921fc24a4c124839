"""The module and parameter hooks through which the engine follows forward and backward.

[Note: stage 3 hooks]
* forward pre-hook of every module that needs units (see [Note: stage 3 units] in
  :mod:`zpp.zero.planning`): gather them for :attr:`Phase.FORWARD` and count a forward
  user; forward hook: drop the user, release at zero users (when the policy reshards after
  forward, and always without grad), and (with grad enabled) register a hook on each
  output that requires grad. That hook runs when the output's gradient is ready, i.e.
  right before the module's own backward, and gathers its units for
  :attr:`Phase.BACKWARD` (a no-op for units still gathered).
  Gathers go through the engine's :class:`~zpp.zero.prefetch.Prefetcher`, which serves them
  from gathers it started ahead when the order follows the recorded trace (see
  [Note: stage 3 prefetch]); the root module's forward pre-hook opens a pass, the end of
  ``engine.backward`` (or of a forward without grad) closes it.
* ``register_post_accumulate_grad_hook`` on every trainable parameter (with sharded
  gradients) counts down its unit's missing gradients; at zero the unit reduces its flat
  gradient into its fp32 shard accumulator and releases the full buffer. A leaf's hook runs
  once per backward however often the parameter was used, so tied parameters are reduced
  once.
* ``engine.backward`` then flushes, in unit order, every unit whose gradients did not all
  arrive (unused parameters count as zeros) and releases whatever is still gathered.
Every rank must run the same graph, as with DDP: collectives are issued in hook order.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zpp.zero.comm_api import Phase
from zpp.zero.planning import UnitPlan
from zpp.zero.policy import ShardingPolicy
from zpp.zero.prefetch import Prefetcher
from zpp.zero.unit import Unit


def install_hooks(module: torch.nn.Module, plan: UnitPlan, *, policy: ShardingPolicy,
                  prefetcher: Prefetcher) -> list[RemovableHandle]:
    """Install the hooks of [Note: stage 3 hooks] that the policy needs; the handles."""
    handles: list[RemovableHandle] = []
    if policy.shard_parameters:
        # the pass hooks run before / after the root's own: see [Note: stage 3 prefetch]
        handles.append(module.register_forward_pre_hook(
            lambda _m, _a: prefetcher.begin_pass(torch.is_grad_enabled())))
        for m, units in plan.needs:
            handles.append(m.register_forward_pre_hook(_pre_forward(units, prefetcher)))
            handles.append(m.register_forward_hook(_post_forward(units, prefetcher, policy.reshard_after_forward)))

        def end_forward(_m, _a, _out):
            if not torch.is_grad_enabled():
                prefetcher.end_pass()

        handles.append(module.register_forward_hook(end_forward))
    if policy.reduce_each_micro_step:
        for u in plan.units:
            if u.trainable:
                hook = _grad_ready(u)
                handles.extend(p.register_post_accumulate_grad_hook(hook) for p in u.params if p.requires_grad)
    return handles


def _pre_forward(units: tuple[Unit, ...], prefetcher: Prefetcher) -> Callable:
    def hook(_module, _args):
        for u in units:
            u.forward_users += 1
            prefetcher.gather(u, Phase.FORWARD)
    return hook


def _post_forward(units: tuple[Unit, ...], prefetcher: Prefetcher, reshard: bool) -> Callable:
    def pre_backward(_grad):
        for u in units:
            prefetcher.gather(u, Phase.BACKWARD)

    def hook(_module, _args, output):
        grad = torch.is_grad_enabled()
        for u in units:
            u.forward_users -= 1
            if u.forward_users == 0 and (reshard or not grad):
                u.release()
        if grad:
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(pre_backward)
    return hook


def _grad_ready(unit: Unit) -> Callable:
    def hook(_param):
        unit.pending -= 1
        if unit.pending == 0 and not unit.reduced:
            unit.reduce_grads()
            unit.release()
    return hook
