"""Fault injection: NaN or Inf in one rank's gradient (issue 12, point 3).

A gradient hook puts a NaN or an Inf into one element of one rank's gradient at one step
(never rank 0's, so the other ranks learn it only through the check). In every case, on
every rank:

* the step is skipped: ``was_step_applied()`` False, ``optimizer.overflow`` True,
  ``skipped_steps`` 1, ``global_steps`` still advances;
* the weights (parameters, fp32 masters, full buffers) and the optimizer state (moments,
  1-bit error-feedback buffers and counters) are bit-identical before and after the step;
* the next steps are *exactly* those of a run that never saw the bad batch (the same
  batches less that one): equal losses and final weights, bit for bit. Exact equality is
  achievable because a skipped step changes no state that later steps read (the engine
  also invalidates hpZ's secondary copy, as a step does, so the next passes gather the way
  they would have);
* the check's traffic: nothing of its own where it rides on a collective that runs anyway
  (stages 0-3 and ZeRO++; 1-bit with clipping), one 4-byte ``nonfinite_check`` all-reduce
  per step otherwise (1-bit without clipping, the 1-bit optimizers used directly);
* ``zpp.nonfinite: "raise"`` (``nonfinite="raise"`` for a 1-bit optimizer used directly):
  the same skip, then ``NonFiniteGradientError`` naming the step on every rank.

Covered: stages 0-3 (2 ranks; bf16 at stage 3), ZeRO++ with every switch (2 nodes x 2
ranks), AdamW and SGD, the 1-bit optimizers through the engine (warm-up and compression
stage, 0/1 Adam on a local step and on a sync) and used directly, the MPI transport (stage
2). Worlds have hard timeouts shorter than pytest's.
"""
import pytest
import torch

import zpp.optim as zo
import zpp.zero as zz
from tests.dist import needs_mpi, run_world
from tests.gpt import GPT, GPTConfig
from zpp.comm.nonfinite import CHECK_OP
from zpp.optim._common import FusedOneBitOptimizer

STEPS = 7
BAD = float("nan"), float("inf")
HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
ONEBIT = {
    "OneBitAdam": dict(freeze_step=3),
    # variance frozen after 3 steps; then local-step interval 1, 2 (syncs every other step)
    "ZeroOneAdam": dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2),
    "OneBitLamb": dict(freeze_step=3, coeff_beta=0.8),
}


def _gpt():
    torch.manual_seed(4321)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))


def _batches(rank, n=STEPS):
    g = torch.Generator().manual_seed(300 + rank)
    return [(x, x.roll(-1, 1)) for x in (torch.randint(0, 128, (4, 16), generator=g) for _ in range(n))]


def _poison(module, value):
    """A hook putting ``value`` into one element of the first block's MLP weight gradient."""
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[5] = value
        return grad

    return module.blocks[0].fc.weight.register_hook(hook)


def _ds(stage=0, opt="AdamW", clip=0.0, zero=None, sched=False, **zpp):
    params = {"lr": 0.05, "momentum": 0.9} if opt == "SGD" else {**HP, "betas": list(HP["betas"])}
    params.update(ONEBIT.get(opt, {}))
    ds = {"gradient_clipping": clip, "optimizer": {"type": opt, "params": params},
          # persistence 0: stage 3 partitions even this tiny model's parameters
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 900, "stage3_param_persistence_threshold": 0,
                                **(zero or {})}, "zpp": zpp}
    if sched:
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                          "warmup_num_steps": 5, "warmup_type": "linear"}}
    return ds


def _state(engine):
    """Everything a step may change on this rank (no collective): each unit's shard, full
    buffer and fp32 master, and the optimizer's state."""
    out = []
    for u in engine.units:
        f = u.flat
        out += [f.shard, f.full, f.master]
    opt = engine.optimizer
    if isinstance(opt, FusedOneBitOptimizer):  # moments, error feedback, counters, phase
        out.append(opt.state_dict())
    else:
        out.append({id(p): s for p, s in opt.state.items()})
    return _clone(out)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clone(v) for v in x]
    return x


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _train(t, cfg, batches, bad=None, value=None, bad_rank=1):
    """Train on ``batches``; at index ``bad`` rank ``bad_rank`` gets ``value`` in its gradient.
    Returns losses, what the bad step looked like, the final weights, the check's traffic."""
    engine, opt, _, sched = zz.initialize(model=_gpt(), config=cfg, transport=t)
    t.counters.reset()
    losses, seen = [], None
    for i, (x, y) in enumerate(batches):
        hook = _poison(engine.module, value) if i == bad and t.rank == bad_rank else None
        loss = engine(x, y)
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        if i == bad:
            before, lr = _state(engine), engine.get_lr()
        engine.step()
        if i == bad:
            seen = dict(applied=engine.was_step_applied(), overflow=opt.overflow, skipped=engine.skipped_steps,
                        steps=engine.global_steps, unchanged=_equal(before, _state(engine)),
                        lr_kept=engine.get_lr() == lr, norm=engine.get_global_grad_norm())
        else:
            assert engine.was_step_applied() and not opt.overflow
        losses.append(loss.item())
    traffic = t.counters.snapshot().get(CHECK_OP)
    final = engine.consolidated_state_dict()
    engine.close()
    return losses, seen, final, traffic


def _case(t, cfg, bad, value, bad_rank=1):
    """A run with the bad batch against one that never saw it; what the test asserts."""
    batches = _batches(t.rank)
    losses, seen, final, traffic = _train(t, cfg, batches, bad, value, bad_rank)
    clean_losses, _, clean_final, _ = _train(t, cfg, batches[:bad] + batches[bad + 1:])
    return dict(
        seen=seen,
        before_same=losses[:bad] == clean_losses[:bad],
        after_same=losses[bad + 1:] == clean_losses[bad:],
        final_same=_equal(final, clean_final),
        check_calls=None if traffic is None else traffic.calls,
        check_wire=None if traffic is None else traffic.wire_bytes,
    )


def _assert_skipped(results, *, check_calls=None, world=2):
    """Every rank of every case: skipped, unchanged, then exactly the clean run."""
    for r in results:
        for name, c in r.items():
            s = c["seen"]
            assert (s["applied"], s["overflow"], s["skipped"]) == (False, True, 1), (name, s)
            assert s["unchanged"] and s["lr_kept"], (name, s)
            assert c["before_same"] and c["after_same"] and c["final_same"], (name, c)
            if check_calls is None:
                assert c["check_calls"] is None, (name, c)  # the check rode on existing collectives
            else:
                assert c["check_calls"] == check_calls, (name, c)
                assert c["check_wire"] == check_calls * 2 * 4 // world * (world - 1), (name, c)


# ---------------------------------------------------------------------- ZeRO stages
def _world_stages(t):
    out = {}
    for stage in (0, 1, 2, 3):
        for value in BAD:
            out[f"stage{stage}-{value}"] = _case(t, _ds(stage, clip=1.0 if stage == 1 else 0.0,
                                                         sched=stage == 2), 3, value)
    out["stage3-bf16-nan"] = _case(t, {**_ds(3), "bf16": {"enabled": True}}, 3, BAD[0])  # any precision
    out["stage2-sgd-nan"] = _case(t, _ds(2, opt="SGD"), 2, BAD[0])
    out["stage0-sgd-inf"] = _case(t, _ds(0, opt="SGD"), 4, BAD[1])
    return out


@pytest.mark.timeout(420)
def test_nonfinite_skipped_at_every_stage():
    res = run_world(_world_stages, 2, timeout=380)
    _assert_skipped(res)
    assert all(r["stage0-nan"]["seen"]["steps"] == 4 for r in res)  # global_steps counts the skipped step
    assert all(r["stage2-inf"]["seen"]["norm"] == float("inf") for r in res)


def _world_zeropp(t):
    zero = dict(zero_quantized_weights=True, zero_hpz_partition_size=2, zero_quantized_gradients=True)
    return {f"zeropp-{v}": _case(t, _ds(3, zero=zero), 2, v, bad_rank=2) for v in BAD}


@pytest.mark.slow  # 12 s; test_nonfinite_skipped_at_every_stage stays in the quick lane
@pytest.mark.timeout(300)
def test_nonfinite_skipped_with_zeropp_2x2():
    res = run_world(_world_zeropp, 4, ranks_per_node=2, timeout=260)
    _assert_skipped(res, world=4)


# ---------------------------------------------------------------------- 1-bit optimizers
def _world_onebit_engine(t):
    out = {}
    for name in ONEBIT:
        # warm-up (optimizer step 2), compression (step 5; for 0/1 Adam a local step, and step 6,
        # a 1-bit sync)
        for bad, value in ((1, BAD[0]), (4, BAD[1])) + (((5, BAD[0]),) if name == "ZeroOneAdam" else ()):
            out[f"{name}-{bad}-{value}"] = _case(t, _ds(opt=name), bad, value)
    return out


@pytest.mark.timeout(420)
def test_nonfinite_skipped_with_onebit_optimizers_in_the_engine():
    res = run_world(_world_onebit_engine, 2, timeout=380)
    # without clipping the engine adds one 4-byte flag all-reduce per step
    _assert_skipped(res, check_calls=STEPS)


def _world_onebit_clip(t):
    return {f"{name}-clip": _case(t, _ds(opt=name, clip=0.5), 4, BAD[0]) for name in ONEBIT}


@pytest.mark.timeout(300)
def test_nonfinite_skipped_with_onebit_and_clipping():
    res = run_world(_world_onebit_clip, 2, timeout=260)
    _assert_skipped(res)  # the flag rode on the clipping's rms all-reduce


def _counted(state):
    """An optimizer state less the count of skipped steps (which the test checks itself)."""
    return {k: v for k, v in state.items() if k != "skipped_steps"}


def _direct(t, name, batches, bad=None, value=None, nonfinite="skip"):
    model = _gpt()
    params = list(model.parameters())
    opt = zo.build(name, params, transport=t, nonfinite=nonfinite, **HP, **ONEBIT[name])
    t.counters.reset()
    losses, seen = [], None
    for i, (x, y) in enumerate(batches):
        hook = _poison(model, value) if i == bad and t.rank == 1 else None
        loss = model(x, y)
        loss.backward()
        if hook is not None:
            hook.remove()
        if i == bad:
            before = _clone([_counted(opt.state_dict()), [p.detach() for p in params]])
        opt.step()
        opt.zero_grad()
        if i == bad:
            after = _clone([_counted(opt.state_dict()), [p.detach() for p in params]])
            seen = dict(overflow=opt.overflow, skipped=opt.skipped_steps, unchanged=_equal(before, after))
        else:
            assert not opt.overflow
        losses.append(loss.item())
    return losses, seen, model.state_dict(), t.counters.snapshot()[CHECK_OP].calls


def _world_onebit_direct(t):
    out = {}
    batches = _batches(t.rank)
    for name in ONEBIT:
        for bad, value in ((1, BAD[1]), (4, BAD[0])):
            losses, seen, final, calls = _direct(t, name, batches, bad, value)
            clean, _, clean_final, _ = _direct(t, name, batches[:bad] + batches[bad + 1:])
            out[f"{name}-{bad}"] = dict(seen=seen, after=losses[bad + 1:] == clean[bad:],
                                        final=_equal(final, clean_final), calls=calls)
        try:
            _direct(t, name, batches, 4, BAD[1], nonfinite="raise")
            out[f"{name}-raise"] = None
        except zz.NonFiniteGradientError as e:
            out[f"{name}-raise"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_nonfinite_skipped_by_onebit_optimizers_used_directly():
    res = run_world(_world_onebit_direct, 2, timeout=260)
    for r in res:
        for name, c in r.items():
            if name.endswith("-raise"):
                assert c is not None and "step 5" in c and "NaN or Inf" in c, (name, c)
                continue
            assert c["seen"] == dict(overflow=True, skipped=1, unchanged=True), (name, c)
            assert c["after"] and c["final"] and c["calls"] == STEPS, (name, c)


# ---------------------------------------------------------------------- raise, MPI
def _world_raise(t):
    out = {}
    for label, cfg in (("stage0", _ds(0, nonfinite="raise")), ("stage3", _ds(3, nonfinite="raise")),
                       ("OneBitAdam", _ds(opt="OneBitAdam", nonfinite="raise"))):
        engine, *_ = zz.initialize(model=_gpt(), config=cfg, transport=t)
        try:
            for i, (x, y) in enumerate(_batches(t.rank)):
                hook = _poison(engine.module, BAD[0]) if i == 2 and t.rank == 1 else None
                engine.backward(engine(x, y))
                if hook is not None:
                    hook.remove()
                engine.step()
            out[label] = None
        except zz.NonFiniteGradientError as e:
            out[label] = (str(e), engine.skipped_steps, engine.was_step_applied())
        engine.close()
    return out


@pytest.mark.timeout(200)
def test_nonfinite_raise_on_every_rank():
    res = run_world(_world_raise, 2, timeout=160)
    for r in res:
        for label, got in r.items():
            assert got is not None, label
            msg, skipped, applied = got
            assert "optimizer step 3" in msg and "zpp.nonfinite='raise'" in msg, msg
            assert (skipped, applied) == (1, False), label


def _world_mpi(t):
    assert t.name == "mpi"
    return {f"mpi-stage2-{v}": _case(t, _ds(2), 3, v) for v in BAD}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", [pytest.param("mpi", marks=needs_mpi)])
def test_nonfinite_skipped_on_mpi(backend):
    res = run_world(_world_mpi, 2, backend=backend, timeout=260)
    _assert_skipped(res)
