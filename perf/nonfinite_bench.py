"""Cost per step of the non-finite gradient check (issue 12) on the benchmark GPT.

    python perf/nonfinite_bench.py --json perf/results/nonfinite_check.json   # spawns 4 local gloo ranks

The engine checks every optimizer step's gradients on every rank (see [Note: the
non-finite check rides on the norm] in zpp/zero/gradnorm.py): at stages 0-3 and with
ZeRO++ the flag rides on the gradient norm the engine computes anyway, so the check itself
adds one float comparison and no byte; with a 1-bit optimizer and no clipping it scans the
local gradient (``has_nonfinite``) and all-reduces a 4-byte flag (``any_rank_nonfinite``).
For each variant (the GPT of perf/trainlib.py, AdamW or a 1-bit optimizer, ``--warmup``
steps, then ``--steps`` timed ones), rank 0 prints:

* ``step_s``: wall time per step (the probe below subtracted);
* ``check_ms``: the engine's whole ``check_grads`` per step: the gradient norm (computed
  before this check existed, for clipping and ``get_global_grad_norm``) plus what the
  check adds;
* ``scan_ms``, ``flag_ms``: the check's own work: the scan of the local gradient
  (rank-local) and the latency of its 4-byte flag all-reduce, timed alone after a barrier
  (in the step that call also absorbs the wait for the slowest rank, which the step's next
  collective would pay otherwise; the JSON keeps both); both 0 where the check rides on
  the norm;
* ``added_ms`` = scan + flag, and its share of the step;
* ``probe_ms``: a standalone check beside a folded one, for comparison: a scan of this
  rank's gradient (its shard where gradients are sharded) plus the flag latency (what
  folding saves);
* ``check_B``: the check's own wire bytes per rank per step (``nonfinite_check`` in the
  transport's counters), against ``step_B``, all of the step's wire bytes per rank.

Timings come from ``time.perf_counter`` around the calls, summed per step; the row reports
rank 0's median step, the JSON also the maximum of the ranks' medians.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import trainlib  # noqa: E402
from zpp.comm.nonfinite import CHECK_OP, any_rank_nonfinite, has_nonfinite  # noqa: E402

_ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
VARIANTS = {  # name: (optimizer, zero_optimization, fp16)
    "zero0": ("AdamW", {"stage": 0}, False),
    "zero2": ("AdamW", {"stage": 2}, False),
    "zero3": ("AdamW", {"stage": 3}, False),
    "zero3-zeropp": ("AdamW", {"stage": 3, **_ZEROPP}, False),
    "onebitadam": ("OneBitAdam", {"stage": 0}, False),
    "zerooneadam": ("ZeroOneAdam", {"stage": 0}, False),
    # fp16: the flag comes out of the unscaling pass (no scan of its own)
    "onebitadam-fp16": ("OneBitAdam", {"stage": 0}, True),
}
PROBE = "probe_nonfinite_check"


class Timers:
    """Seconds spent in the wrapped calls since the last reset."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def add(self, name, dt):
        self.s[name] = self.s.get(name, 0.0) + dt


def _instrument(t, timers: Timers, probe: bool) -> None:
    """Time the engine's check and its parts; with ``probe``, run a standalone check (scan +
    flag all-reduce, booked as PROBE) before it."""
    import zpp.zero.engine as ze
    import zpp.zero.gradnorm as zg

    zg.has_nonfinite = timers.wrap("scan", has_nonfinite)
    if zg._FUSED_UNSCALE is not None:  # fp16: the scan fused into the unscaling (which runs anyway)
        zg._FUSED_UNSCALE = timers.wrap("scan", torch._amp_foreach_non_finite_check_and_unscale_)
    zg.any_rank_nonfinite = timers.wrap("flag", any_rank_nonfinite)
    check = zg.check_grads

    def check_grads(units, **kw):
        if probe:
            t0 = time.perf_counter()
            bad = any(has_nonfinite(u.flat.grad) for u in units)
            t1 = time.perf_counter()
            flag = torch.tensor([float(bad)])
            with t.counters.collective(PROBE, 4):
                t.all_reduce(flag, "max")
            timers.add("probe_scan", t1 - t0)
            timers.add("probe", time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = check(units, **kw)
        timers.add("check", time.perf_counter() - t0)
        return out

    ze.check_grads = check_grads


def _run_variant(t, name, args, data):
    import zpp.zero as zz

    opt, zero, fp16 = VARIANTS[name]
    params = {"lr": 1e-3, "weight_decay": 0.0}
    if opt == "OneBitAdam":
        params["freeze_step"] = args.warmup  # the timed steps are in the compression stage
    elif opt == "ZeroOneAdam":
        params.update(var_freeze_step=args.warmup, local_step_scaler=1, local_step_clipper=2)
    cfg = {"optimizer": {"type": opt, "params": params}, "zero_optimization": zero,
           "zpp": {"check_metadata": False, "unit_min_numel": 100_000}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}  # no overflow: the timed steps compress
    model = trainlib.make_model(args)
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    timers = Timers()
    _instrument(t, timers, probe=not opt.startswith(("OneBit", "ZeroOne")))
    g = torch.Generator().manual_seed(t.rank)

    def step():
        x, y = data.batch(args.batch, args.block, g)
        engine.backward(engine(x, y))
        engine.step()

    for _ in range(args.warmup):
        step()
    t.barrier()
    t.counters.reset()
    timers.s.clear()
    keys = ("check", "scan", "flag", "probe", "probe_scan")
    per_step = []  # this rank's seconds in each timed call, per step
    t0 = time.perf_counter()
    for _ in range(args.steps):
        before = dict(timers.s)
        step()
        per_step.append([timers.s.get(k, 0.0) - before.get(k, 0.0) for k in keys])
    t.barrier()
    wall = time.perf_counter() - t0
    snap = t.counters.snapshot()
    engine.close()
    latency = _flag_latency(t)
    n = args.steps
    # the median step of each timer (the machine is shared: one slow step must not be the figure)
    mine = torch.tensor(per_step, dtype=torch.float64).median(dim=0).values
    probe_mean = sum(r[3] for r in per_step) / n
    worst = mine.clone()
    t.all_reduce(worst, "max")
    ms = {k: 1e3 * float(v) for k, v in zip(keys, mine)}
    ms_max = {k: 1e3 * float(v) for k, v in zip(keys, worst)}
    check_b = snap[CHECK_OP].wire_bytes / n if CHECK_OP in snap else 0.0
    step_s = wall / n - probe_mean
    flags = 1 if CHECK_OP in snap else 0  # the check's own all-reduces per step
    added = ms["scan"] + flags * latency
    extra = {}
    if fp16 and ms["scan"]:  # the fused pass replaces the plain unscaling multiply: count the difference
        extra = _fused_vs_plain_unscale(psi)
        added = extra["fused_ms"] - extra["mul_ms"] + flags * latency
    return {
        "variant": name, "params": psi, "step_s": step_s,
        # the engine's whole check_grads: the pre-existing norm (and its all-reduce) plus the check
        "check_ms": ms["check"], "check_ms_max": ms_max["check"],
        # the check's own work: the scan (rank-local) and the flag all-reduce, timed in the step
        # (which includes waiting for the slowest rank) and alone (its latency)
        "scan_ms": ms["scan"], "scan_ms_max": ms_max["scan"], "fp16": fp16,
        "flag_in_step_ms": ms["flag"], "flag_latency_ms": latency,
        "added_ms": added, "added_pct_of_step": 100 * added / 1e3 / step_s,
        # a standalone check beside a folded one: scan of this rank's gradient + flag
        "probe_scan_ms": ms["probe_scan"], "probe_scan_ms_max": ms_max["probe_scan"],
        "probe_ms": ms["probe_scan"] + latency if ms["probe"] else 0.0,
        "check_bytes": check_b, "probe_bytes": snap[PROBE].wire_bytes / n if PROBE in snap else 0.0,
        "step_bytes": sum(v.wire_bytes for k, v in snap.items() if k != PROBE) / n,
        **extra,
    }


def _fused_vs_plain_unscale(numel: int, calls: int = 15) -> dict:
    """Median milliseconds of the fused check-and-unscale and of a plain ``mul_`` over a
    ``numel`` fp32 buffer, in this process, called alternately after one call of each (the
    unscaling runs under fp16 with or without the check; the check adds the difference)."""
    x = torch.randn(numel)
    found, inv = torch.zeros(1), torch.full((1,), 1.0)
    fns = {"mul_ms": lambda: x.mul_(1.0),
           "fused_ms": lambda: torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(calls + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i:  # the first round warms both up
                times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * sorted(v)[calls // 2] for k, v in times.items()}


def _flag_latency(t, calls: int = 30) -> float:
    """Median milliseconds of one 4-byte flag all-reduce with every rank ready (a barrier
    first), the check's cost on the wire without the wait for the slowest rank that any
    first collective after backward pays."""
    times = []
    for _ in range(calls):
        t.barrier()
        t0 = time.perf_counter()
        any_rank_nonfinite(t, False)
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def _rank_main(t, args):
    from tests.gpt import CharCorpus

    data = CharCorpus(max_bytes=2_000_000)
    rows = [_run_variant(t, name, args, data) for name in args.variants]
    if t.rank != 0:
        return
    print(f"# nonfinite_bench: world={t.world_size} warmup={args.warmup} steps={args.steps} "
          f"GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block} batch={args.batch} "
          f"params={rows[0]['params']}")
    print(f"{'variant':<14}{'step_s':>8}{'check_ms':>10}{'scan_ms':>9}{'flag_ms':>9}{'added_ms':>10}"
          f"{'added_%':>9}{'probe_ms':>10}{'check_B':>9}{'probe_B':>9}{'step_B':>13}")
    for r in rows:
        flag = r["flag_latency_ms"] if r["check_bytes"] else 0.0
        print(f"{r['variant']:<14}{r['step_s']:>8.3f}{r['check_ms']:>10.2f}{r['scan_ms']:>9.2f}{flag:>9.3f}"
              f"{r['added_ms']:>10.2f}{r['added_pct_of_step']:>8.3f}%{r['probe_ms']:>10.2f}"
              f"{r['check_bytes']:>9.0f}{r['probe_bytes']:>9.0f}{r['step_bytes']:>13.0f}")
    if args.json:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host": socket.gethostname(), "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
               "git_revision": rev, "torch": torch.__version__, "world": t.world_size,
               "load_average": os.getloadavg(),
               "model": {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "block", "batch", "steps",
                                                      "warmup")},
               "rows": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=8, n_embd=512, block=128, batch=1, steps=3, warmup=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.set_defaults(n_head=8)  # the 25M GPT of perf/BENCHMARKS.md: 8 layers x 512, 8 heads
    args = p.parse_args(argv)
    trainlib.parse_variants(p, args, VARIANTS)
    trainlib.launch(_rank_main, args)


if __name__ == "__main__":
    main()
