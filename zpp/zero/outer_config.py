"""The hierarchical mode's section of the typed configuration (``"zpp": {"outer": {...}}``,
:class:`OuterConfig`); the mode itself is :mod:`zpp.zero.outer`.

[Note: the outer lr rule]
DiLoCo's outer step (Nesterov, lr 0.7, momentum 0.9) was published for H in the hundreds.
At short H it overshoots, the more the larger the model: on tests/gpt.py's GPTs over 2 nodes
with H = 10 (4 fragments, delay 1, int4), lr 0.5 ended 0.1-1.0% above DDP's loss at equal
tokens at 0.2M parameters but 6-11% above at 0.8M, while lr 0.2 with H = 5 ended 1.0-2.6%
above on every size and seed studied (perf/BENCHMARKS.md, "The outer lr at short H").
Without an explicit ``lr`` the "diloco" method therefore takes

    lr(H) = 0.2                                  for H <= 10     (this study, 2 nodes)
    lr(H) = 0.2 * 3.5 ** log10(H / 10)           for 10 < H < 100 (geometric in between)
    lr(H) = 0.7                                  for H >= 100    (DiLoCo's)

Measured: 0.2 at H = 5 and 10 here, 0.7 by the DiLoCo paper; the geometric bridge is not
measured, and neither is H < 5 beyond one case (H = 2 and 3 at lr 0.2 ended worse than
H = 5). It has no term in the number of nodes: at 4 nodes H = 5 with lr 0.2 ended 9.3%
above DDP on the 0.8M GPT (one seed). The rule is for the default momentum 0.9: with another ``momentum`` set ``lr`` as
well (lr 1.0 with momentum 0.6 ended 11% above DDP at H = 10).

[Note: the mode's defaults]
``"outer": {}`` is H = 5, 4 fragments, delay 1, int4 outer gradients and the "diloco" step at
lr(5) = 0.2: of the outer settings perf/BENCHMARKS.md tried on tests/gpt.py's GPTs, the one
closest to DDP's loss at equal tokens. DiLoCo's own (H = 100, one fragment, fp32, lr 0.7), the
defaults before, ended 6.7-8.3% above DDP's held-out loss on the 0.8M GPT where these ended
0.5-2.3% above. Shorter H (2, 3) ended worse; int4 measured the same loss as fp32 and int8
(held-out, to 0.1%) at 1/8 of fp32's bytes; delay 1 hides one step of the link at no measured
cost. On 2 nodes they stay within 2% of DDP's held-out loss on the 0.2M GPT and on two of three
seeds of the 0.8M one, and end up to 7% above it on the 1.6M-25M GPTs and at 4 nodes ("The
mode's defaults become the measured setting"); the README's hierarchical section says where,
and what to set instead. ``zpp tune`` never advises an H below :data:`DEFAULT_SYNC_EVERY`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from zpp.zero.checks import check_bool, check_choice, check_int, check_number, fail, from_section

__all__ = ["DEFAULT_SYNC_EVERY", "OUTER_COMPRESSIONS", "OUTER_METHODS", "OuterConfig", "outer_lr_rule"]

OUTER_METHODS = ("diloco", "sgd", "average")
OUTER_COMPRESSIONS = ("none", "int8", "int4", "1bit", "topk")

#: the default H: the shortest that did not lose loss (see [Note: the mode's defaults])
DEFAULT_SYNC_EVERY = 5

#: (H, lr) at the two measured ends of [Note: the outer lr rule]
SHORT_H, SHORT_LR = 10, 0.2
LONG_H, LONG_LR = 100, 0.7


def outer_lr_rule(sync_every: int) -> float:
    """The "diloco" outer learning rate for H = ``sync_every`` (see [Note: the outer lr rule])."""
    if sync_every <= SHORT_H:
        return SHORT_LR
    if sync_every >= LONG_H:
        return LONG_LR
    return SHORT_LR * (LONG_LR / SHORT_LR) ** (math.log(sync_every / SHORT_H) / math.log(LONG_H / SHORT_H))


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class OuterConfig:
    """The hierarchical mode (``"zpp": {"outer": {...}}``): the ZeRO stage and ZeRO++ switches
    run inside each node; across nodes the replicas train apart for ``sync_every`` inner
    steps and are reconciled by an outer optimizer on the averaged pseudo-gradient (DiLoCo,
    Streaming DiLoCo). See :mod:`zpp.zero.outer`."""

    method: Literal["diloco", "sgd", "average"] = "diloco"
    """What the pseudo-gradient ``delta`` (weights at the last sync minus the current
    weights, averaged over the nodes) does to the synced weights ``anchor``: "diloco": SGD
    with momentum (Nesterov by default) on ``delta``, as DiLoCo's outer optimizer; "sgd":
    ``anchor - lr * delta``; "average": ``anchor - delta``, the mean of the nodes' weights
    (Default: "diloco")."""
    sync_every: int = DEFAULT_SYNC_EVERY
    """H: inner optimizer steps between two syncs of each fragment (Default: 5, see
    [Note: the mode's defaults])."""
    lr: float | None = None
    """The outer learning rate; None: for "diloco" :func:`outer_lr_rule` of ``sync_every``
    (0.2 at H <= 10 up to DiLoCo's 0.7 at H >= 100, see [Note: the outer lr rule]), 1.0 for
    "sgd"; "average" takes only None or 1 (Default: None)."""
    momentum: float | None = None
    """"diloco": the outer momentum, in [0, 1); None: 0.9 (DiLoCo's). "sgd" and "average"
    take only None or 0 (Default: None)."""
    nesterov: bool = True
    """"diloco": Nesterov momentum (DiLoCo's), else heavy-ball (Default: True)."""
    compression: Literal["none", "int8", "int4", "1bit", "topk"] = "int4"
    """How the pseudo-gradient crosses the nodes: "none": an fp32 all-reduce; "int8" /
    "int4": a group-quantized reduce-scatter, then a quantized all-gather of the mean;
    "1bit": the 1-bit all-reduce with error feedback (:mod:`zpp.comm.onebit`), whose error
    buffers are checkpointed; "topk": in every chunk of 4096 entries the largest 64, as int16
    index + int8 value (one fp32 scale per chunk), with error feedback, all-gathered
    (:class:`~zpp.zero.outer.reduce.SparseMean`)
    (Default: "int4")."""
    group_size: int = 2048
    """int8 / int4: elements per fp32 scale (Default: 2048)."""
    fragments: int = 4
    """F: each rank's trainable weights cut into this many pieces of equal size, each
    synced once per ``sync_every`` steps on its own staggered schedule, so the inter-node
    traffic is spread over the steps (Streaming DiLoCo); at most the trainable elements of a
    rank's shards (Default: 4)."""
    delay: int | str | None = None
    """tau: inner steps from the start of a fragment's sync to the application of its outer
    update, during which the sync runs in the background; 0: the step waits for it. Must be
    below ``sync_every``. ``"auto"``: 1 until the first update lands, then the fewest steps
    that cover the slowest sync measured so far (its seconds over the mean inner step's,
    rounded up, at most ``sync_every - 1``), the same on every rank. None: 1, or 0 when
    ``sync_every`` is 1 (the object holds the number) (Default: None)."""
    mix: float = 0.5
    """With ``delay`` > 0: when a fragment's update lands, its weights become
    ``mix * local + (1 - mix) * synced`` (Streaming DiLoCo's merge of the tau local steps);
    0 takes the synced weights. Unused without delay (Default: 0.5)."""

    def __post_init__(self) -> None:
        w = "OuterConfig"
        check_choice(w, "method", self.method, OUTER_METHODS)
        check_int(w, "sync_every", self.sync_every, lo=1)
        if self.lr is not None:
            check_number(w, "lr", self.lr, lo=0, lo_open=True)
        if self.momentum is not None:
            check_number(w, "momentum", self.momentum, lo=0, hi=1, hi_open=True)
        check_bool(w, "nesterov", self.nesterov)
        check_choice(w, "compression", self.compression, OUTER_COMPRESSIONS)
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2:
            raise fail(w, "group_size", g, "a positive even integer")
        check_int(w, "fragments", self.fragments, lo=1)
        if self.delay is None:  # frozen: the resolved default is stored once, here
            object.__setattr__(self, "delay", 1 if self.sync_every > 1 else 0)
        if self.delay == "auto":
            if self.sync_every < 2:
                raise ValueError(f"{w}: delay='auto' needs sync_every >= 2 (a delay below it), got "
                                 f"sync_every={self.sync_every}")
        else:
            check_int(w, "delay", self.delay, lo=0, hi=self.sync_every - 1)
        check_number(w, "mix", self.mix, lo=0, hi=1)
        if self.method == "average" and self.lr not in (None, 1, 1.0):
            raise ValueError(f"{w}: lr={self.lr!r} with method='average' (which is lr 1 without momentum); "
                             "use method='sgd' for another outer learning rate")
        if self.method != "diloco" and self.momentum not in (None, 0, 0.0):
            raise ValueError(f"{w}: momentum={self.momentum!r} with method={self.method!r}, which has no "
                             "momentum; use method='diloco'")

    @property
    def outer_lr(self) -> float:
        """The outer learning rate in force (``lr``, or the method's default)."""
        if self.lr is not None:
            return float(self.lr)
        return outer_lr_rule(self.sync_every) if self.method == "diloco" else 1.0

    @property
    def outer_momentum(self) -> float:
        """The outer momentum in force (0 without momentum)."""
        if self.method != "diloco":
            return 0.0
        return 0.9 if self.momentum is None else float(self.momentum)

    @classmethod
    def from_mapping(cls, where: str, d: Any) -> OuterConfig:
        """From a dict (the JSON section); unknown keys and bad values raise ``ValueError``
        naming ``where.key`` and the value."""
        if not isinstance(d, Mapping):
            raise fail(where, "outer", d, "a JSON object (dict) or null")
        return from_section(cls, where, "outer", d)
