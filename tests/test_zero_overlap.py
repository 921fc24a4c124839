"""Gradient reductions overlapped with the backward (``overlap_comm``; [Note: overlapped
reductions] in zpp/zero/reduce/overlap.py), on a real 2 nodes x 2 gloo world and under mpiexec.

* Exact: every variant trains to the same bits with the reductions on the communication
  thread as with them in line (losses, master weights, wire bytes), at stages 1-3, with
  ZeRO++ (qwZ + hpZ + qgZ), fp16 loss scaling and gradient accumulation.
* qgZ's two hops pipelined (its inter-node hop on a second worker): the same bits, and every
  ZeRO++ reduction took that path.
* Overlapped, shown without a clock: the first reduction of the backward (the last block's)
  is held until the backward has reached the first block. In line that cannot happen (the
  backward waits for the reduction), so the same gate must time out there: the check fails
  when reductions do not overlap.
* The reason it does not overlap, where it cannot (one rank, the 1-bit optimizers), and the
  DeepSpeed key's default (on at stage 3, off below).
"""
import threading

import pytest
import torch

import zpp.zero as zz
from tests.dist import mpi_available, run_world
from tests.gpt import GPT, GPTConfig
from tests.test_zero_engine import _batches, train_steps
from zpp.zero.deepspeed_config import from_deepspeed

STEPS = 4
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
VARIANTS = {  # name -> (zero_optimization extras, top-level extras)
    "stage1": ({"stage": 1}, {}),
    "stage2": ({"stage": 2}, {}),
    "stage3": ({"stage": 3}, {}),
    "stage3-zeropp": ({"stage": 3, **ZEROPP}, {}),
    "stage3-fp16": ({"stage": 3}, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "stage3-gas2": ({"stage": 3}, {"gradient_accumulation_steps": 2}),
}


def _model(n_layer=2):
    torch.manual_seed(7)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, block_size=16))


def _config(zero, top, overlap):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero, "overlap_comm": overlap}}
    cfg.update(top)
    return cfg


def _run(t, name, overlap):
    zero, top = VARIANTS[name]
    engine, _, _, _ = zz.initialize(model=_model(), config=_config(zero, top, overlap), transport=t)
    t.counters.reset()
    losses = train_steps(engine, _batches("gpt", t.rank, STEPS * engine.gradient_accumulation_steps()))
    masters = [u.flat.master.detach().clone() for u in engine.units if u.trainable]
    reducer = engine.comms.reducer
    threaded = reducer.started if reducer is not None else 0
    hop2 = reducer.hop2_started if reducer is not None else 0
    waits = engine.link_waits()
    out = {"losses": losses, "masters": masters, "bytes": t.counters.snapshot(), "threaded": threaded, "hop2": hop2,
           "reason": engine.overlap_reason, "waits": waits}
    engine.close()
    return out


def _exact(t, names):
    return {name: {overlap: _run(t, name, overlap) for overlap in (False, True)} for name in names}


def _check_exact(results, names):
    for rank, r in enumerate(results):
        for name in names:
            inline, overlapped = r[name][False], r[name][True]
            assert inline["threaded"] == 0 and inline["reason"] == "overlap_comm is off", (name, inline["reason"])
            assert overlapped["threaded"] > 0 and overlapped["reason"] == "", (name, overlapped["reason"])
            # qgZ's inter-node hops ran on the second worker, every one of them (2 x 2 world)
            expect_hop2 = overlapped["threaded"] if "zeropp" in name else 0
            assert overlapped["hop2"] == expect_hop2, (name, overlapped["hop2"], overlapped["threaded"])
            assert overlapped["losses"] == inline["losses"], (rank, name, overlapped["losses"], inline["losses"])
            for a, b in zip(overlapped["masters"], inline["masters"], strict=True):
                assert torch.equal(a, b), (rank, name)
            assert overlapped["bytes"] == inline["bytes"], (rank, name)
            assert inline["waits"].get("reduce", 0) > 0, (name, inline["waits"])


@pytest.mark.timeout(300)
def test_overlapped_reductions_are_exact():
    names = list(VARIANTS)
    results = run_world(_exact, 4, ranks_per_node=2, args=(names,), timeout=270)
    _check_exact(results, names)


@pytest.mark.timeout(200)
@pytest.mark.skipif(not mpi_available(), reason="needs mpiexec and mpi4py")
def test_overlapped_reductions_are_exact_mpi():
    names = ["stage2", "stage3-zeropp"]
    results = run_world(_exact, 4, backend="mpi", ranks_per_node=2, args=(names,), timeout=170)
    _check_exact(results, names)


def _gated(t, overlap, hold_s):
    """Train one step with the first reduction held until the backward reaches block 0."""
    from zpp.zero.reduce.reduce_scatter import ReduceScatterMean

    reached, first = threading.Event(), [True]
    plain_start = ReduceScatterMean.start

    def start(self, flat, layout):
        if first[0]:
            first[0] = False
            if not reached.wait(hold_s):
                raise RuntimeError("the backward did not reach block 0 while the first reduction was held")
        return plain_start(self, flat, layout)

    ReduceScatterMean.start = start
    model = _model(n_layer=3)
    model.blocks[0].register_full_backward_pre_hook(lambda *_: reached.set())
    engine, _, _, _ = zz.initialize(model=model, config=_config({"stage": 3}, {}, overlap), transport=t)
    try:
        train_steps(engine, _batches("gpt", t.rank, 1))
    except RuntimeError as exc:
        return f"error: {exc}"
    finally:
        engine.close()
    return "trained"


@pytest.mark.timeout(120)
def test_reductions_run_while_the_backward_continues():
    assert run_world(_gated, 2, args=(True, 30.0), timeout=100) == ["trained"] * 2
    # the same gate in line: the backward waits for the held reduction, which times out
    out = run_world(_gated, 2, args=(False, 3.0), timeout=100)
    assert all("did not reach block 0" in o for o in out), out


def _reasons(t):
    out = {}
    for name, cfg in (("stage3-default", {"zero_optimization": {"stage": 3}}),
                      ("stage2-default", {"zero_optimization": {"stage": 2}}),
                      ("onebit", {"zero_optimization": {"stage": 0, "overlap_comm": True},
                                  "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}})):
        cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **cfg}
        engine, _, _, _ = zz.initialize(model=_model(1), config=cfg, transport=t)
        out[name] = (engine.comms.reducer is not None, engine.overlap_reason)
        engine.close()
    return out


@pytest.mark.timeout(120)
def test_when_reductions_overlap():
    r = run_world(_reasons, 2, timeout=100)[0]
    assert r["stage3-default"] == (True, "")
    assert r["stage2-default"] == (False, "overlap_comm is off")  # DeepSpeed's default below stage 3
    assert r["onebit"] == (False, "the 1-bit optimizers reduce in their step")
    one = run_world(_reasons, 1, timeout=100)[0]
    assert one["stage3-default"] == (False, "one rank: nothing to overlap")


def test_overlap_comm_key():
    assert from_deepspeed({"zero_optimization": {"stage": 3}}).zero.overlaps_reductions
    assert not from_deepspeed({"zero_optimization": {"stage": 2}}).zero.overlaps_reductions
    assert from_deepspeed({"zero_optimization": {"stage": 2, "overlap_comm": True}}).zero.overlaps_reductions
    assert not from_deepspeed({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero.overlaps_reductions
    with pytest.raises(ValueError, match="overlap_comm"):
        from_deepspeed({"zero_optimization": {"stage": 3, "overlap_comm": "yes"}})


def _failed_pass(t, overlap):
    """A backward that raises half-way (after the last blocks' reductions started), caught
    as a training loop skips an OOM (zero_grad, next batch), then 2 steps: losses, masters."""
    model = _model(n_layer=3)
    fail = [True]

    def boom(*_):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("out of memory (simulated)")
    model.blocks[0].register_full_backward_pre_hook(boom)
    engine, _, _, _ = zz.initialize(model=model, config=_config({"stage": 3}, {}, overlap), transport=t)
    batches = _batches("gpt", t.rank, 3)
    x, y = batches[0]
    try:
        engine.backward(engine(x, y))
    except RuntimeError as exc:
        assert "simulated" in str(exc)
    engine.zero_grad()
    pending = sum(len(u.pending) for u in engine.units)
    losses = train_steps(engine, batches[1:])
    masters = [u.flat.master.detach().clone() for u in engine.units if u.trainable]
    engine.close()
    return losses, masters, pending


@pytest.mark.timeout(120)
def test_a_failed_backward_leaves_no_reduction_behind():
    """The reductions a failed pass started are waited for and dropped, as the in-line path's
    are dropped by zero_grad: the next steps train the same bits either way."""
    inline = run_world(_failed_pass, 2, args=(False,), timeout=100)
    overlapped = run_world(_failed_pass, 2, args=(True,), timeout=100)
    for (l1, m1, p1), (l2, m2, p2) in zip(inline, overlapped, strict=True):
        assert p1 == p2 == 0
        assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(m1, m2, strict=True))


def _rebuilt(t, name, times):
    """Build, train one step and close an engine ``times`` times; after each close, the
    process groups this rank holds and its open file descriptors."""
    import os

    from torch.distributed import distributed_c10d as c10d

    zero, top = VARIANTS.get(name, ({"stage": 2}, {"zpp": {"outer": {"sync_every": 2}}}))
    held = []
    for _ in range(times):
        engine, _, _, _ = zz.initialize(model=_model(), config=_config(zero, top, True), transport=t)
        train_steps(engine, _batches("gpt", t.rank, 2))
        made = [w for w in (engine.comms.reducer.world if engine.comms.reducer else None,
                            getattr(engine.outer, "inter", None)) if w is not None]
        assert made  # a duplicate of the world was made (the reductions', or the outer sync's)
        engine.close()
        if t.name == "mpi":  # each duplicate's communicator (and its topology's) is freed
            from mpi4py import MPI

            held.append(all(w.comm == MPI.COMM_NULL for w in made))
        else:
            held.append((len(c10d._world.pg_map), len(os.listdir("/proc/self/fd"))))
    return held


@pytest.mark.parametrize("name", ["stage3", "stage3-zeropp", "outer"])
def test_a_closed_engine_frees_its_duplicate_worlds(name):
    """The reduction thread's duplicate of the world (and, with qgZ, the topology built over
    it), and the hierarchical mode's duplicate for its sync (one rank per node), are freed at
    close: engines built one after another (a notebook, a hyper-parameter search) hold no
    more process groups or sockets than the first."""
    rpn = 1 if name == "outer" else 2
    for held in run_world(_rebuilt, 4, ranks_per_node=rpn, args=(name, 4), timeout=150):
        groups, fds = zip(*held)
        assert len(set(groups)) == 1, held  # each close gives back what its engine made
        assert max(fds) <= fds[0] + 2, held


@pytest.mark.slow  # 9 s
@pytest.mark.timeout(200)
@pytest.mark.skipif(not mpi_available(), reason="needs mpiexec and mpi4py")
def test_a_closed_engine_frees_its_duplicate_communicators_mpi():
    for held in run_world(_rebuilt, 4, backend="mpi", ranks_per_node=2, args=("stage3-zeropp", 2), timeout=170):
        assert held == [True, True]


class _Pipelined:
    """A fake pipelined strategy: ``start`` and the ``wait()`` it leaves behind record their
    thread; the second part of reduction 0 holds (up to ``hold_s``) until reduction ``gate``'s
    ``start`` has begun (which only a second worker allows); ``start`` of ``fail_at`` raises;
    ``held`` is what each second part says it holds (``Reduction.held_numel``)."""

    pipelined = True

    def __init__(self, fail_at=None, gate=1, hold_s=10, held=None):
        self.log, self.fail_at, self.gate, self.hold_s, self.held = [], fail_at, gate, hold_s, held
        self.began = {i: threading.Event() for i in range(8)}

    def start(self, flat, layout):
        i = int(flat[0])
        self.began[i].set()
        self.log.append(("start", i, threading.current_thread().name))
        if i == self.fail_at:
            raise RuntimeError(f"start {i} failed")

        def second():
            if i == 0 and not self.began[self.gate].wait(self.hold_s):
                raise RuntimeError(f"reduction {self.gate} did not start while reduction 0's second part ran")
            self.log.append(("wait", i, threading.current_thread().name))

        from zpp.comm.transport import Work
        from zpp.zero.comm_api import Reduction
        return Reduction(flat * 2, Work("fake", second, asynchronous=False), held_numel=self.held)


class _NoWorld:
    def free(self):
        pass


def _thread(reduce):
    from zpp.zero.reduce.overlap import LinkWaits, ReductionThread
    return ReductionThread(reduce, world=_NoWorld(), max_numel=1 << 20, clock=LinkWaits())


def test_a_pipelined_reduction_runs_its_second_part_beside_the_next_start():
    reduce = _Pipelined()
    worker = _thread(reduce)
    started = [worker.start(torch.full((4,), float(i)), None, f"unit {i}") for i in range(4)]
    results = [r.wait() for r in started]
    worker.close()
    for i, out in enumerate(results):
        assert torch.equal(out, torch.full((4,), 2.0 * i))
    assert worker.hop2_started == 4
    # each part in the order started, on its own worker
    assert [i for kind, i, _ in reduce.log if kind == "start"] == [0, 1, 2, 3]
    assert [i for kind, i, _ in reduce.log if kind == "wait"] == [0, 1, 2, 3]
    threads = {kind: {name for k, _, name in reduce.log if k == kind} for kind in ("start", "wait")}
    assert len(threads["start"]) == len(threads["wait"]) == 1 and threads["start"] != threads["wait"], threads


def test_a_pipelined_reduction_hands_on_its_error():
    reduce = _Pipelined(fail_at=2)
    worker = _thread(reduce)
    started = [worker.start(torch.full((4,), float(i)), None, f"unit {i}") for i in range(4)]
    assert torch.equal(started[1].wait(), torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="start 2 failed"):
        started[2].wait()
    assert torch.equal(started[3].wait(), torch.full((4,), 6.0))
    worker.close()
    assert worker.hop2_started == 3


@pytest.mark.parametrize("held", [0, None])
def test_the_memory_bound_counts_what_a_second_part_still_holds(held):
    """Room for one unit's gradient: with the first parts done and their second parts holding
    nothing, reductions 1 and 2 start while reduction 0's second part is still running; a
    second part that holds the whole gradient (None) makes reduction 2 wait for 0 instead."""
    from zpp.zero.reduce.overlap import LinkWaits, ReductionThread

    reduce = _Pipelined(gate=2, hold_s=5, held=held)
    worker = ReductionThread(reduce, world=_NoWorld(), max_numel=4, clock=LinkWaits())
    started = [worker.start(torch.full((4,), float(i)), None, f"unit {i}") for i in range(3)]
    if held == 0:
        for i, r in enumerate(started):
            assert torch.equal(r.wait(), torch.full((4,), 2.0 * i))
    else:
        with pytest.raises(RuntimeError, match="reduction 2 did not start"):
            started[0].wait()
    worker.close()
