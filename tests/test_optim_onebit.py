"""1-bit Adam, 0/1 Adam and 1-bit LAMB (zpp.optim) against plain-torch references.

Every world runs all its checks at once (spawning ranks is the expensive part):

* warm-up steps equal ``torch.optim.AdamW`` (Adam with decoupled weight decay) or the
  per-tensor LAMB reference (tests/onebit_sim.py), on the mean gradient;
* every later step equals a plain-torch simulation of the whole algorithm with all ranks in
  one process (tests/onebit_sim.py is the 1-bit all-reduce of zpp.comm.onebit, written again);
* replicas stay bit-identical; a checkpoint taken in the compression stage resumes exactly;
  bf16 parameters follow the fp32 run through the optimizer's fp32 master copy;
* a short training run converges within 3% of the uncompressed optimizer.

Gradients are multiples of 1/64 so that their mean is exact in any summation order.
"""
import io
import math
import warnings

import pytest
import torch

import zpp.optim as zo
from tests.dist import needs_mpi, run_world
from tests.onebit_sim import Lamb, OneBitSim

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (40, 3)]  # 193 elements, none a multiple of 8
HP = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
ONEBIT_ADAM = dict(freeze_step=6)
ZERO_ONE = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
# bounds tight enough that every clip of the trust ratio and of its factor is taken
ONEBIT_LAMB = dict(freeze_step=6, max_coeff=2.0, min_coeff=0.8, coeff_beta=0.9,
                   factor_max=1.6, factor_min=0.8, factor_threshold=0.1)
STEPS = 20


def _grads(rank, step, shapes=SHAPES):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return [torch.randint(-64, 65, s, generator=g).float() / 64 * (1 + rank) for s in shapes]


def _init_params(dtype=torch.float32):
    g = torch.Generator().manual_seed(1234)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _flat(ts):
    return torch.cat([t.detach().float().reshape(-1) for t in ts])


def _split(flat):
    out, o = [], 0
    for s in SHAPES:
        n = math.prod(s)
        out.append(flat[o:o + n])
        o += n
    return out


def _gather(t, x):
    out = torch.empty(t.world_size * x.numel(), dtype=x.dtype)
    t.all_gather(out, x.contiguous())
    return out.view(t.world_size, -1)


# ---------------------------------------------------------------------- references
def _onebit_mean(n, W):
    """The optimizers' 1-bit mean over W ranks: OneBitSim, or nothing sent with one rank."""
    return (lambda xs: xs[0].clone()) if W == 1 else OneBitSim(n, W)


def _sim_onebit_adam(W, steps, lr, betas, eps, weight_decay, freeze_step):
    """Master parameters after each step, per rank: (steps, W, n)."""
    xs = [p.detach().clone().requires_grad_() for p in _init_params()]
    ref = torch.optim.AdamW(xs, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    b1, b2 = betas
    out, ob = [], _onebit_mean(sum(x.numel() for x in xs), W)
    for t in range(1, steps + 1):
        gs = [_flat(_grads(r, t)) for r in range(W)]
        if t <= freeze_step:
            for x, g in zip(xs, _split(sum(gs) / W)):
                x.grad = g.view_as(x).clone()
            ref.step()
        else:
            if t == freeze_step + 1:
                m = _flat([ref.state[x]["exp_avg"] for x in xs])
                v = _flat([ref.state[x]["exp_avg_sq"] for x in xs])
            m = ob(torch.stack([b1 * m + (1 - b1) * g for g in gs]))
            with torch.no_grad():
                for x, mi, vi in zip(xs, _split(m), _split(v)):
                    d = vi.sqrt() / math.sqrt(1 - b2 ** freeze_step) + eps
                    x.mul_(1 - lr * weight_decay).sub_((lr / (1 - b1 ** t)) * (mi / d).view_as(x))
        out.append(_flat(xs).expand(W, -1).clone())
    return torch.stack(out)


def _sim_zero_one_adam(W, steps, lr, betas, eps, weight_decay, var_freeze_step, var_update_scaler,
                       local_step_scaler, local_step_clipper):
    """Algorithm 1 of the paper, every rank a row: local momentum and step, the accumulated
    ``u = sum gamma m`` 1-bit averaged (scaled per tensor by 1 / rms(d)) at each sync."""
    b1, b2 = betas
    x0 = _flat(_init_params())
    X, M, v, anchor = x0.expand(W, -1).clone(), torch.zeros(W, x0.numel()), torch.zeros_like(x0), x0.clone()
    var_interval, var_counter, var_updates, lsi, lsc, lrs = 1, 0, 0, 1, 0, 0.0
    sizes = torch.tensor([math.prod(s) for s in SHAPES])
    ob, out = _onebit_mean(x0.numel(), W), []
    for t in range(1, steps + 1):
        G = torch.stack([_flat(_grads(r, t)) for r in range(W)])
        full = t <= var_freeze_step and t % var_interval == 0
        if full:
            G = G.mean(0).expand(W, -1)
            v = b2 * v + (1 - b2) * G[0] * G[0]
            var_updates += 1
        d = v.sqrt() / math.sqrt(1 - b2 ** var_updates) + eps
        gamma = lr / (1 - b1 ** t)
        M = b1 * M + (1 - b1) * G
        X = X * (1 - lr * weight_decay) - gamma * M / d
        anchor = anchor * (1 - lr * weight_decay)
        lrs += gamma
        if not full and t % lsi == 0:
            k = torch.repeat_interleave(1 / torch.stack([s.norm() / math.sqrt(s.numel()) for s in _split(d)]), sizes)
            ub = ob((anchor - X) * d * k) / k
            M = (ub / lrs).expand(W, -1).clone()
            X = (anchor - ub / d).expand(W, -1).clone()
        if full or t % lsi == 0:
            anchor, lrs = X[0].clone(), 0.0
        if full:
            var_counter += 1
            if var_counter == var_update_scaler:
                var_counter, var_interval = 0, 2 * var_interval
        if t > var_freeze_step:
            lsc += 1
            if lsc == local_step_scaler:
                lsc, lsi = 0, min(local_step_clipper, 2 * lsi)
        out.append(X.clone())
    return torch.stack(out)


def _sim_onebit_lamb(W, steps, lr, betas, eps, weight_decay, freeze_step, factor_max, factor_min,
                     factor_threshold, **lamb_kw):
    b1, b2 = betas
    xs = [p.detach().clone() for p in _init_params()]
    ref = Lamb(xs, lr, betas, eps, weight_decay, **lamb_kw)
    sizes = [x.numel() for x in xs]
    ob, out = _onebit_mean(sum(sizes), W), []
    for t in range(1, steps + 1):
        gs = [_flat(_grads(r, t)) for r in range(W)]
        if t <= freeze_step:
            ref.step([g.view_as(x) for g, x in zip(_split(sum(gs) / W), xs)])
            if t == freeze_step:
                m, v = _flat(ref.m), _flat(ref.v)
                v_fresh, last = v.clone(), [1.0] * len(xs)
                scales = torch.stack([mi.norm() / math.sqrt(mi.numel()) for mi in _split(m)])
                k = torch.repeat_interleave(scales.mean() / scales, torch.tensor(sizes))
        else:
            m_prev = m
            m = ob(torch.stack([(b1 * m + (1 - b1) * g) * k for g in gs])) / k
            g_rec = (m - b1 * m_prev) / (1 - b1)
            v_fresh = b2 * v_fresh + (1 - b2) * g_rec * g_rec
            for i, (x, mi, vi, fi) in enumerate(zip(xs, _split(m), _split(v), _split(v_fresh))):
                d = vi.sqrt() / math.sqrt(1 - b2 ** freeze_step) + eps
                pre = (mi / (1 - b1 ** t) / d).view_as(x)
                u = pre + weight_decay * x
                f = float((d / (fi.sqrt() / math.sqrt(1 - b2 ** t) + eps)).max())
                if weight_decay:
                    r = min(1.0, float(pre.norm() / u.norm()))
                    f = f * r + (1 - r)
                f = min(max(f, factor_min), factor_max)
                f = min(max(f, last[i] * (1 - factor_threshold)), last[i] * (1 + factor_threshold))
                last[i] = f
                x -= lr * ref.frozen[i] * f * u
        out.append(_flat(xs).expand(W, -1).clone())
    return torch.stack(out)


CASES = {
    "OneBitAdam": (ONEBIT_ADAM, _sim_onebit_adam),
    "ZeroOneAdam": (ZERO_ONE, _sim_zero_one_adam),
    "OneBitLamb": (ONEBIT_LAMB, _sim_onebit_lamb),
}


# ---------------------------------------------------------------------- checks in a world
def _run(opt, params, t, start, stop, dtype=torch.float32):
    """Steps start+1 .. stop with this rank's gradients; the master after each step."""
    out = []
    for step in range(start + 1, stop + 1):
        for p, g in zip(params, _grads(t.rank, step)):
            p.grad = g.to(dtype)
        opt.step()
        out.append(opt.flat.master.clone())
    return out


def _check_against_simulation(t, name):
    extra, sim = CASES[name]
    W = t.world_size
    want = sim(W, STEPS, **HP, **extra)[:, t.rank]
    params = _init_params()
    opt = zo.build(name, params, transport=t, **HP, **extra)
    got = _run(opt, params, t, 0, STEPS)
    for step, (g, w) in enumerate(zip(got, want), 1):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6, msg=lambda m, s=step: f"{name} step {s}: {m}")
    # the parameters hold the master values
    assert torch.equal(_flat(params), opt.flat.master)
    # replicas: bit-identical on every rank after a synchronised step (every step here)
    rows = _gather(t, opt.flat.master)
    assert torch.equal(rows, rows[0].expand_as(rows)), name
    return opt


def _check_wire_bytes(t, name, opt, params):
    """Warm-up sends one fp32 all-reduce; compression one 1-bit all-reduce (~1/32)."""
    extra = CASES[name][0]
    n = opt.flat.numel
    fresh = zo.build(name, [p.detach().clone().requires_grad_() for p in params], transport=t, **HP, **extra)
    t.counters.reset()
    _run(fresh, fresh.flat.params, t, 0, 1)
    snap = t.counters.snapshot()
    assert snap["all_reduce"].calls == 1 and snap["all_reduce"].logical_bytes == 4 * n
    assert "onebit_all_reduce" not in snap
    t.counters.reset()
    _run(opt, params, t, STEPS, STEPS + 1)  # compression stage (0/1 Adam: local-step interval 4)
    snap = t.counters.snapshot()
    assert "all_reduce" not in snap, snap
    if name == "ZeroOneAdam":
        assert "onebit_all_reduce" not in snap  # a local step: nothing on the wire
        _run(opt, params, t, STEPS + 1, STEPS + 4)  # 24 % 4 == 0: a sync
        snap = t.counters.snapshot()
    if t.world_size > 1:  # per peer: my signs' chunk and scale, then my server chunk and scale
        W = t.world_size
        c = -(-n // (8 * W)) * 8
        assert snap["onebit_all_reduce"].calls == 1
        assert snap["onebit_all_reduce"].logical_bytes == 4 * n
        assert snap["onebit_all_reduce"].wire_bytes == (W - 1) * 2 * (c // 8 + 4)


def _check_checkpoint(t, name):
    """Save in the compression stage, resume on fresh objects: identical from then on."""
    extra = CASES[name][0]
    save_at = 13 if name != "ZeroOneAdam" else 15  # 0/1 Adam: between two syncs (interval 4)
    params = _init_params()
    opt = zo.build(name, params, transport=t, **HP, **extra)
    _run(opt, params, t, 0, save_at)
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()}, buf)
    straight = _run(opt, params, t, save_at, STEPS)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    assert ck["optim"]["rank"] == t.rank and ck["optim"]["step"] == save_at
    params2 = [torch.nn.Parameter(p.clone()) for p in ck["model"]]
    opt2 = zo.build(name, params2, transport=t, **HP, **extra)
    opt2.load_state_dict(ck["optim"])
    resumed = _run(opt2, params2, t, save_at, STEPS)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b), name
    # another rank's (or another world's) state: replicated parts load, errors are reset
    if t.world_size > 1:
        foreign = dict(ck["optim"], rank=(t.rank + 1) % t.world_size)
        opt3 = zo.build(name, [torch.nn.Parameter(p.clone()) for p in ck["model"]], transport=t, **HP, **extra)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt3.load_state_dict(foreign)
        assert any("error-feedback" in str(w.message) for w in caught)
        assert opt3.compressor is None and opt3.step_count == save_at
    with pytest.raises(ValueError, match="algorithm"):
        other = "OneBitAdam" if name != "OneBitAdam" else "OneBitLamb"
        zo.build(other, [torch.nn.Parameter(p.clone()) for p in ck["model"]], transport=t).load_state_dict(ck["optim"])


def _check_bf16(t, name):
    """bf16 parameters: the fp32 master follows an fp32 run from the same (rounded) start
    exactly; the parameters are its rounding; an outside write to a parameter is picked up."""
    extra = CASES[name][0]
    params = _init_params(torch.bfloat16)
    opt = zo.build(name, params, transport=t, **HP, **extra)
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref = zo.build(name, ref_params, transport=t, **HP, **extra)
    got = _run(opt, params, t, 0, STEPS, dtype=torch.bfloat16)
    want = _run(ref, ref_params, t, 0, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert torch.equal(_flat(params), opt.flat.master.to(torch.bfloat16).float())
    assert not torch.equal(_flat(params), opt.flat.master)  # the master keeps more bits
    rows = _gather(t, opt.flat.master)
    assert torch.equal(rows, rows[0].expand_as(rows))
    with torch.no_grad():
        params[1][3] = 7.0
    opt.flat.sync_from_params()
    assert opt.flat.master[35 + 3] == 7.0 and opt.flat.master[35 + 4] == got[-1][35 + 4]


def _check_warmup_equals_torch(t):
    """Warm-up of the Adam variants is AdamW on the mean gradient, op for op."""
    W = t.world_size
    for name, extra in [("OneBitAdam", dict(freeze_step=100)), ("ZeroOneAdam", dict(var_update_scaler=100))]:
        params = _init_params()
        opt = zo.build(name, params, transport=t, **HP, **extra)
        xs = _init_params()
        ref = torch.optim.AdamW(xs, **HP, foreach=False)
        for step in range(1, 9):
            for p, g in zip(params, _grads(t.rank, step)):
                p.grad = g
            opt.step()
            for x, *gs in zip(xs, *[_grads(r, step) for r in range(W)]):
                x.grad = sum(gs) / W
            ref.step()
            torch.testing.assert_close(_flat(params), _flat(xs), rtol=1e-6, atol=1e-7)
    # and plain Adam when weight_decay=0
    params, xs = _init_params(), _init_params()
    hp = dict(HP, weight_decay=0.0)
    opt, ref = zo.OneBitAdam(params, transport=t, **hp), torch.optim.Adam(xs, **hp, foreach=False)
    for step in range(1, 6):
        for p, x, *gs in zip(params, xs, *[_grads(r, step) for r in range(W)]):
            p.grad, x.grad = gs[t.rank], sum(gs) / W
        opt.step()
        ref.step()
    torch.testing.assert_close(_flat(params), _flat(xs), rtol=1e-6, atol=1e-7)


def _check_backend_by_name(t):
    """Without ``transport=``, ``comm_backend_name`` picks the world transport of the registry."""
    names = ["mpi"] if t.name == "mpi" else ["nccl", "gloo", "torch"]
    for backend in names:
        params = _init_params()
        opt = zo.OneBitAdam(params, comm_backend_name=backend, **HP, **ONEBIT_ADAM)
        assert opt.transport.name == t.name and opt.transport.world_size == t.world_size
        _run(opt, params, t, 0, 2)
    want = _sim_onebit_adam(t.world_size, 2, **HP, **ONEBIT_ADAM)[-1, t.rank]
    torch.testing.assert_close(opt.flat.master, want, rtol=2e-5, atol=2e-6)


def _all_checks(t):
    _check_backend_by_name(t)
    for name in CASES:
        opt = _check_against_simulation(t, name)
        _check_wire_bytes(t, name, opt, opt.flat.params)
        _check_checkpoint(t, name)
        _check_bf16(t, name)
    _check_warmup_equals_torch(t)
    return True


WORLDS = [("torch", 2), pytest.param("torch", 4, marks=pytest.mark.slow), pytest.param("mpi", 2, marks=needs_mpi)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend,world", WORLDS, ids=["gloo-w2", "gloo-w4", "mpi-w2"])
def test_onebit_optimizers(backend, world):
    assert run_world(_all_checks, world, backend=backend, timeout=200) == [True] * world


# ---------------------------------------------------------------------- local checks
def test_bad_arguments():
    params = _init_params()
    with pytest.raises(ValueError, match=r"comm_backend_name='hccl'.*\['gloo', 'mpi', 'nccl', 'torch'\]"):
        zo.OneBitAdam(params, comm_backend_name="hccl")
    for cls in (zo.OneBitAdam, zo.ZeroOneAdam, zo.OneBitLamb):
        with pytest.raises(NotImplementedError, match="amsgrad"):
            cls(params, amsgrad=True)
    with pytest.raises(ValueError, match="freeze_step=0"):
        zo.OneBitAdam(params, freeze_step=0)
    with pytest.raises(ValueError, match="betas"):
        zo.OneBitLamb(params, betas=(0.9, 1.0), comm_backend_name="gloo", transport=_Solo())
    with pytest.raises(ValueError, match="unknown optimizer 'Lion'.*OneBitAdam"):
        zo.build("Lion", params)
    with pytest.raises(NotImplementedError, match="float64"):
        zo.OneBitAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], transport=_Solo())
    assert zo.build("onebitadam", params, transport=_Solo()).__class__ is zo.OneBitAdam
    assert zo.build("ZeroOneAdam", params, transport=_Solo(), var_freeze_step=5).var_freeze_step == 5


def test_param_groups_and_frozen_parameters():
    """Per-group hyperparameters apply to their slice; a frozen parameter is never touched."""
    def groups(ps):
        return [{"params": ps[:2], "lr": 0.05, "weight_decay": 0.1}, {"params": ps[2:], "betas": (0.8, 0.95)}]

    params, xs = _init_params(), _init_params()
    params[3].requires_grad_(False)
    xs[3].requires_grad_(False)
    frozen = params[3].detach().clone()
    opt = zo.OneBitAdam(groups(params), lr=0.01, transport=_Solo())
    ref = torch.optim.AdamW(groups(xs), lr=0.01, weight_decay=0.0, foreach=False)
    for step in range(1, 6):
        for p, x, g in zip(params, xs, _grads(0, step)):
            if p.requires_grad:
                p.grad, x.grad = g, g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(_flat(params), _flat(xs), rtol=1e-6, atol=1e-7)
    assert torch.equal(params[3], frozen)
    assert opt.flat.numel == sum(p.numel() for p in params) - 1
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def _Solo():
    from zpp.comm.transport import Transport

    class Solo(Transport):  # a one-rank transport without a process group
        name = "solo"

        def __init__(self):
            super().__init__(0, 1, [0], [0])

        def _all_gather(self, out, inp): ...
        def _reduce_scatter(self, out, inp, op): ...
        def _all_reduce(self, t, op): ...
        def _all_to_all(self, out, inp): ...
        def _broadcast(self, t, src): ...
        def barrier(self): ...
        def _subgroup(self, members): ...

    return Solo()


# ---------------------------------------------------------------------- convergence
CONV_STEPS, CONV_BATCH, CONV_NOISE = 300, 32, 0.3
CONV_RUNS = [  # label, optimizer, lr, arguments; compression starts after 20% of the steps
    ("Adam", "adam", 1e-2, {}),
    ("OneBitAdam", "OneBitAdam", 1e-2, dict(freeze_step=CONV_STEPS // 5)),
    ("ZeroOneAdam", "ZeroOneAdam", 1e-2, dict(var_freeze_step=CONV_STEPS // 5, local_step_scaler=80,
                                               local_step_clipper=2)),
    ("LAMB", "lamb", 2e-2, {}),
    ("OneBitLamb", "OneBitLamb", 2e-2, dict(freeze_step=CONV_STEPS // 5)),
]


def _regression_batch(rank, step, n):
    """A noisy teacher (linear plus a small tanh part), noise std CONV_NOISE: the loss floor
    is CONV_NOISE**2, reached early, so the variance is stable after warm-up as in the papers."""
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(16, 32, generator=g)[:, :4] / 4
    w2 = torch.randn(32, 1, generator=g)[:4] / math.sqrt(32)
    a = torch.randn(16, 1, generator=g) / 4
    g = torch.Generator().manual_seed(100000 * rank + step)
    x = torch.randn(n, 16, generator=g)
    return x, x @ a + 1.2 * torch.tanh(x @ w1) @ w2 + CONV_NOISE * torch.randn(n, 1, generator=g)


def _mlp():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(p.shape[-1]))
    return model


def _train(t, kind, lr, extra):
    model = _mlp()
    params = list(model.parameters())
    if kind == "adam":
        opt = torch.optim.Adam(params, lr=lr)
    elif kind == "lamb":
        opt = Lamb([p.data for p in params], lr, (0.9, 0.999), 1e-8, 0.0)
    else:
        opt = zo.build(kind, params, lr=lr, transport=t, **extra)
    for step in range(CONV_STEPS):
        lr_now = lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * step / CONV_STEPS)))
        x, y = _regression_batch(t.rank, step, CONV_BATCH)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if kind in ("adam", "lamb"):  # the uncompressed counterparts: fp32 mean of the gradients
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            t.all_reduce(flat, op="mean")
            for p, g in zip(params, _split_like(flat, params)):
                p.grad.copy_(g)
        if kind == "lamb":
            opt.lr = lr_now
            with torch.no_grad():
                opt.step([p.grad for p in params])
        else:
            for group in opt.param_groups:
                group["lr"] = lr_now
            opt.step()
    x, y = _regression_batch(-1, 0, 4096)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def _split_like(flat, params):
    out, o = [], 0
    for p in params:
        out.append(flat[o:o + p.numel()].view_as(p))
        o += p.numel()
    return out


def _convergence(t):
    t.check_metadata = False  # many small calls; the shapes never change
    return {label: _train(t, kind, lr, extra) for label, kind, lr, extra in CONV_RUNS}


@pytest.mark.timeout(240)
def test_convergence_against_uncompressed():
    losses = run_world(_convergence, 2, backend="torch", timeout=200)
    assert losses[0] == losses[1]  # replicas agree at the end
    loss = losses[0]
    floor = CONV_NOISE ** 2
    report = ", ".join(f"{k} {v:.5f} (excess {v - floor:.5f})" for k, v in loss.items())
    print(f"\nfinal eval MSE after {CONV_STEPS} steps on 2 ranks: {report}")
    for name, base in [("OneBitAdam", "Adam"), ("ZeroOneAdam", "Adam"), ("OneBitLamb", "LAMB")]:
        assert loss[name] <= 1.03 * loss[base], report
    assert max(loss.values()) < 1.5 * floor, report  # every run learned the teacher
