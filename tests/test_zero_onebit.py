"""The 1-bit optimizers (zpp.optim) through zpp.initialize, ZeRO stage 0.

* config: DeepSpeed ``optimizer.type`` OneBitAdam / ZeroOneAdam / OneBitLamb translate with
  their own parameter names (unknown ones are a ValueError naming them); ZeRO stage >= 1 is
  a NotImplementedError saying why;
* parity (2 ranks): the engine trains exactly like the optimizer used directly on a plain
  model (same losses, same weights), with gradient accumulation, bf16 parameters, and
  gradient clipping by the rms of the ranks' local gradient norms (the engine's documented
  rule); the engine sends no gradient all-reduce of its own;
* checkpoints (2 ranks): saved in the compression stage (0/1 Adam between two syncs, when
  the ranks' weights differ) and resumed on a fresh engine, the losses are identical;
* convergence (2 ranks): a small GPT on the stdlib character corpus; each 1-bit optimizer's
  final eval loss is within 3% of its uncompressed counterpart's (AdamW for both Adams;
  for 1-bit LAMB, plain per-tensor LAMB from tests/onebit_sim.py on the mean gradient,
  outside zpp's optimizer and engine).
"""
import inspect
import math

import pytest
import torch

import zpp.optim as zo
import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, CharCorpus, GPTConfig
from tests.onebit_sim import Lamb
from tests.test_zero_engine import train_steps
from zpp.zero.config import OPTIMIZER_PARAMS, TrainConfig, from_deepspeed

NAMES = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
EXTRA = {
    "OneBitAdam": dict(freeze_step=5),
    # variance frozen after 8 steps; local-step interval 1, 2, then 4 (syncs at 16, 20, ...)
    "ZeroOneAdam": dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4),
    "OneBitLamb": dict(freeze_step=5, max_coeff=5.0, min_coeff=0.05, coeff_beta=0.8, factor_max=2.0,
                       factor_min=0.5, factor_threshold=0.2),
}
STEPS = 20


def _ds(name, gas=1, clip=0.0, bf16=False, stage=0, **more):
    return {
        "train_micro_batch_size_per_gpu": 4 if gas == 1 else 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": name, "params": {**HP, "betas": list(HP["betas"]), **EXTRA[name], **more}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},  # several buckets
        "bf16": {"enabled": bf16},
    }


# ---------------------------------------------------------------------- config (no world)
@pytest.mark.parametrize("name", NAMES)
def test_config_translates_onebit(name):
    cfg = from_deepspeed(_ds(name, cuda_aware=False, comm_backend_name="nccl", bias_correction=True))
    assert cfg.optimizer.type == name.lower() and cfg.optimizer.onebit
    assert cfg.optimizer.params == {**HP, **EXTRA[name], "cuda_aware": False, "comm_backend_name": "nccl",
                                    "bias_correction": True}
    assert cfg.optimizer.params["betas"] == (0.9, 0.99)  # JSON lists become tuples


@pytest.mark.parametrize("name", NAMES)
def test_config_params_are_the_optimizers_own(name):
    """The accepted names are exactly the constructor's (less params, transport and
    nonfinite, which the engine sets: its own transport, its own non-finite check)."""
    cls = zo.OPTIMIZERS[name]
    own = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "transport", "nonfinite"}
    assert OPTIMIZER_PARAMS[name.lower()] == own
    other = {"OneBitAdam": "var_freeze_step", "ZeroOneAdam": "freeze_step", "OneBitLamb": "local_step_clipper"}[name]
    ds = {"optimizer": {"type": name, "params": {"lr": 1e-3, other: 3, "momentum": 0.9}}}
    with pytest.raises(ValueError) as e:
        from_deepspeed(ds)
    assert other in str(e.value) and "momentum" in str(e.value), str(e.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_zero_stage_raises(name, stage):
    for make in (lambda: from_deepspeed(_ds(name, stage=stage)),
                 lambda: TrainConfig(optimizer=from_deepspeed(_ds(name)).optimizer, zero=zz.ZeroConfig(stage=stage))):
        with pytest.raises(NotImplementedError) as e:
            make()
        msg = str(e.value)
        assert name in msg and f"stage {stage}" in msg and "shards the optimizer state" in msg, msg
        assert "momentum" in msg and "error feedback" in msg, msg


# ---------------------------------------------------------------------- parity (2 ranks)
def _gpt():
    torch.manual_seed(1234)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))


def _batches(rank, n, batch=4):
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        x = torch.randint(0, 128, (batch, 16), generator=g)
        out.append((x, x.clone()))
    return out


def _rms_clip(t, params, clip):
    """The engine's rule for 1-bit optimizers: one coefficient from the rms of local norms."""
    sq = sum(p.grad.double().pow(2).sum() for p in params).reshape(1).clone()
    t.all_reduce(sq, "sum")
    rms = float((sq[0] / t.world_size).sqrt())
    coef = clip / (rms + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return rms


def _direct(t, name, batches, gas=1, clip=0.0, bf16=False):
    """The optimizer on a plain model: no engine, no DDP (step() communicates)."""
    model = _gpt()
    if bf16:
        model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = zo.build(name, params, transport=t, **HP, **EXTRA[name])
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        (loss / gas if gas > 1 else loss).backward()
        losses.append(loss.item())
        if (i + 1) % gas == 0:
            if clip:
                norms.append(_rms_clip(t, params, clip))
            opt.step()
            opt.zero_grad()
    return losses, norms, model.state_dict()


def _engine(t, name, batches, **cfg):
    engine, opt, _, _ = zz.initialize(model=_gpt(), config=_ds(name, **cfg), transport=t)
    losses, norms = [], []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.is_gradient_accumulation_boundary() and engine.get_global_grad_norm() is not None:
            norms.append(engine.get_global_grad_norm())
    return losses, norms, engine


def _same(a_losses, a_state, b_losses, b_state):
    return a_losses == b_losses and all(torch.equal(a_state[k], b_state[k]) for k in a_state)


def _parity(t):
    out = {}
    torch.manual_seed(0)
    other = torch.nn.Linear(3, 3)
    for name in NAMES:
        # the config builds the right class with the given parameters, on the engine's transport
        engine, opt, _, _ = zz.initialize(model=_gpt(), config=_ds(name), transport=t)
        assert type(opt) is zo.OPTIMIZERS[name] and opt is engine.optimizer and opt.transport is t
        for k, v in EXTRA[name].items():
            assert (getattr(opt, k) if hasattr(opt, k) else opt.param_groups[0][k]) == v, (name, k)
        g = opt.param_groups[0]
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (HP["lr"], HP["betas"], HP["eps"],
                                                                      HP["weight_decay"])
        assert opt.flat.numel == sum(p.numel() for p in engine.module.parameters())  # no bucket padding
        engine.close()

        batches = _batches(t.rank, STEPS)
        ref = _direct(t, name, batches)
        losses, _, engine = _engine(t, name, batches)
        out[f"{name}"] = _same(ref[0], ref[2], losses, engine.module.state_dict())
        # accumulation: two micro-batches of 2 per step, accumulated locally, one communication
        micro = [(x[i:i + 2], y[i:i + 2]) for x, y in batches[:12] for i in (0, 2)]
        ref = _direct(t, name, micro, gas=2)
        losses, _, engine = _engine(t, name, micro, gas=2)
        assert engine.global_steps == 12 and engine.optimizer.step_count == 12
        out[f"{name}-gas2"] = _same(ref[0], ref[2], losses, engine.module.state_dict())
        # clipping (small max norm: every step clips) by the rms of the local norms
        ref = _direct(t, name, batches[:12], clip=0.05)
        losses, norms, engine = _engine(t, name, batches[:12], clip=0.05)
        assert min(norms) > 0.05, norms
        out[f"{name}-clip-losses"] = max(abs(a - b) / b for a, b in zip(losses, ref[0], strict=True))
        out[f"{name}-clip-norms"] = max(abs(a - b) / b for a, b in zip(norms, ref[1], strict=True))
    # bf16 parameters: the engine's fp32 masters and the optimizer's own fp32 copy agree
    ref = _direct(t, "OneBitAdam", batches[:12], bf16=True)
    losses, _, engine = _engine(t, "OneBitAdam", batches[:12], bf16=True)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    out["OneBitAdam-bf16"] = _same(ref[0], ref[2], losses, engine.module.state_dict())

    # the engine sends nothing of its own: warm-up one fp32 all-reduce (the optimizer's),
    # compression one 1-bit all-reduce; gradient accumulation does not add any
    engine, opt, _, _ = zz.initialize(model=_gpt(), config=_ds("OneBitAdam", gas=2), transport=t)
    n = opt.flat.numel
    for step, (x, y) in enumerate(micro[:16]):
        if step % 4 == 0:
            t.counters.reset()
        engine.backward(engine(x, y))
        engine.step()
        if step == 3:  # optimizer steps 1-2: warm-up
            snap = t.counters.snapshot()
            assert snap["all_reduce"].calls == 2 and snap["all_reduce"].logical_bytes == 2 * 4 * n, snap
            assert "onebit_all_reduce" not in snap, snap
        if step == 15:  # optimizer steps 7-8: compression (freeze_step 5)
            snap = t.counters.snapshot()
            assert "all_reduce" not in snap and snap["onebit_all_reduce"].calls == 2, snap

    # wrong ways in: every rank raises the same error
    errors = {}
    for label, kw in [
        ("given", dict(optimizer=zo.OneBitAdam(other.parameters(), transport=t), config={})),
        ("both", dict(optimizer=torch.optim.SGD(other.parameters(), lr=0.1), config=_ds("OneBitAdam"))),
        ("backend", dict(config=_ds("OneBitAdam", comm_backend_name="mpi"))),
    ]:
        try:
            zz.initialize(model=_gpt(), transport=t, **kw)
            errors[label] = None
        except (ValueError, NotImplementedError) as e:
            errors[label] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


@pytest.mark.timeout(300)
def test_engine_matches_direct_optimizer():
    results = run_world(_parity, 2, backend="torch", timeout=270)
    assert results[0]["errors"] == results[1]["errors"]
    for rank, res in enumerate(results):
        errors = res.pop("errors")
        for key, val in res.items():
            if key.endswith(("-clip-losses", "-clip-norms")):  # the norms' float64 sums run in another order
                assert val < 1e-5, (rank, key, val)
            else:
                assert val is True, (rank, key)
    assert errors["given"].startswith("ValueError") and "config" in errors["given"], errors["given"]
    assert errors["both"].startswith("ValueError") and "both" in errors["both"], errors["both"]
    assert "comm_backend_name='mpi'" in errors["backend"] and "'torch'" in errors["backend"], errors["backend"]


# ---------------------------------------------------------------------- checkpoints (2 ranks)
SAVE_AT = {"OneBitAdam": 11, "ZeroOneAdam": 17, "OneBitLamb": 11}  # all in compression; 0/1 Adam: 16 < 17 < 20


def _resume(t, root):
    out = {}
    batches = _batches(t.rank, STEPS)
    for name in NAMES:
        d = f"{root}/{name}"
        engine, opt, _, _ = zz.initialize(model=_gpt(), config=_ds(name), transport=t)
        for x, y in batches[:SAVE_AT[name]]:
            engine.backward(engine(x, y))
            engine.step()
        # the ranks' weights differ between 0/1 Adam's syncs: each rank must resume its own
        mine = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        both = torch.empty(2 * mine.numel())
        t.all_gather(both, mine)
        out[f"{name}-ranks-differ"] = not torch.equal(both[:mine.numel()], both[mine.numel():])
        engine.save_checkpoint(d, tag="ck")
        straight = train_steps(engine, batches[SAVE_AT[name]:])
        torch.manual_seed(999)  # other initial weights: the checkpoint must overwrite them
        fresh = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
        engine2, opt2, _, _ = zz.initialize(model=fresh, config=_ds(name), transport=t)
        engine2.load_checkpoint(d)
        assert engine2.global_steps == SAVE_AT[name] and opt2.step_count == SAVE_AT[name]
        assert opt2.compressor is not None  # this rank's error-feedback buffers came back
        out[name] = (straight, train_steps(engine2, batches[SAVE_AT[name]:]))
    # a checkpoint without 1-bit state (another optimizer's) is refused
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = zz.initialize(model=_gpt(), config=cfg, transport=t)
    engine.save_checkpoint(f"{root}/adamw")
    engine, _, _, _ = zz.initialize(model=_gpt(), config=_ds("OneBitAdam"), transport=t)
    try:
        engine.load_checkpoint(f"{root}/adamw")
        out["foreign"] = None
    except FileNotFoundError as e:
        out["foreign"] = str(e)
    return out


@pytest.mark.timeout(240)
def test_checkpoint_resume_in_compression_stage(tmp_path):
    results = run_world(_resume, 2, backend="torch", timeout=210, args=(str(tmp_path),))
    for rank, res in enumerate(results):
        for name in NAMES:
            straight, resumed = res[name]
            assert straight == resumed, (rank, name, straight, resumed)
        assert res["ZeroOneAdam-ranks-differ"], rank  # saved between syncs
        assert not res["OneBitAdam-ranks-differ"], rank  # replicas agree after every step
        assert "OneBitAdam state" in res["foreign"], res["foreign"]
    assert sorted(p.name for p in (tmp_path / "ZeroOneAdam" / "ck").glob("onebit_optim_rank*.pt")) == [
        "onebit_optim_rank00000.pt", "onebit_optim_rank00001.pt"]


# ---------------------------------------------------------------------- convergence (2 ranks)
CONV_STEPS = 300
CONV_FREEZE = CONV_STEPS // 5  # compression after 20% of the steps
CONV_MODEL = dict(n_layer=2, n_embd=48, n_head=4, block_size=32)
CONV_BATCH = 16
# 0/1 Adam: the variance is updated on every step up to the freeze (var_update_scaler =
# var_freeze_step) and the local-step interval grows 1 -> 2 -> 4 (from steps 121 and 181).
# Measured against AdamW (2 ranks, this task): this schedule +0.1%; syncing every step -1.8%;
# the incumbent's kappa, var_update_scaler=16 (1-bit syncs between the variance updates of
# steps 17-60), +5.2% (+5.9% with its local steps scaled, local_step_scaler=20): on a run
# this short the 1-bit steps before the variance settles cost more than in the paper's runs.
CONV_RUNS = [  # label, optimizer type, lr, params
    ("AdamW", "AdamW", 3e-3, {}),
    ("OneBitAdam", "OneBitAdam", 3e-3, dict(freeze_step=CONV_FREEZE)),
    ("ZeroOneAdam", "ZeroOneAdam", 3e-3, dict(var_freeze_step=CONV_FREEZE, var_update_scaler=CONV_FREEZE,
                                               local_step_scaler=CONV_FREEZE, local_step_clipper=4)),
    ("LAMB", "lamb-reference", 1e-2, {}),  # tests/onebit_sim.py's plain LAMB, no engine
    ("OneBitLamb", "OneBitLamb", 1e-2, dict(freeze_step=CONV_FREEZE)),
]
CONV_WARMUP = CONV_STEPS // 10


def _scheduled_lr(lr, step):
    """DeepSpeed's WarmupDecayLR with linear warm-up from 0, written out: the lr of step
    ``step`` (from 0), the schedule at iteration ``step - 1`` (0 before the first; see [Note:
    which lr a step uses] in zpp/zero/schedule_base.py)."""
    t = step - 1
    if t < CONV_WARMUP:
        return lr * max(t, 0) / CONV_WARMUP
    return lr * max(0.0, (CONV_STEPS - t) / (CONV_STEPS - CONV_WARMUP))


def _train_gpt_lamb_reference(t, corpus, evals, lr):
    """The uncompressed counterpart of 1-bit LAMB without zpp's optimizer or engine: plain
    per-tensor LAMB (tests/onebit_sim.py) on the fp32 mean of the ranks' gradients, the same
    model, batches, hyperparameters (OneBitLamb's defaults eps 1e-8, max_coeff 10, min_coeff
    0.01) and schedule as :func:`_train_gpt`."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONV_MODEL))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = Lamb([p.data for p in params], lr, (0.9, 0.99), 1e-8, 0.01)
    g = torch.Generator().manual_seed(t.rank)
    for step in range(CONV_STEPS):
        x, y = corpus.batch(CONV_BATCH, CONV_MODEL["block_size"], g)
        model.zero_grad()
        model(x, y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        t.all_reduce(flat, op="mean")
        grads = list(torch.split(flat, [p.numel() for p in params]))
        opt.lr = _scheduled_lr(lr, step)
        with torch.no_grad():
            opt.step([gr.view_as(p) for gr, p in zip(grads, params)])
    model.eval()
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in evals) / len(evals)


def _train_gpt(t, corpus, evals, kind, lr, extra):
    if kind == "lamb-reference":
        return _train_gpt_lamb_reference(t, corpus, evals, lr)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONV_MODEL))
    cfg = {
        "train_micro_batch_size_per_gpu": CONV_BATCH,
        "optimizer": {"type": kind, "params": {"lr": lr, "betas": [0.9, 0.99], "weight_decay": 0.01, **extra}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                          "warmup_num_steps": CONV_WARMUP,
                                                          "warmup_type": "linear",
                                                          "total_num_steps": CONV_STEPS}},
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = zz.initialize(model=model, config=cfg, transport=t)
    g = torch.Generator().manual_seed(t.rank)
    for _ in range(CONV_STEPS):
        x, y = corpus.batch(CONV_BATCH, CONV_MODEL["block_size"], g)
        engine.backward(engine(x, y))
        engine.step()
    engine.eval()
    with torch.no_grad():
        return sum(float(engine(x, y)) for x, y in evals) / len(evals)


def _convergence(t):
    t.check_metadata = False  # many small calls; the shapes never change
    corpus = CharCorpus(max_bytes=1_000_000)
    held_out = CharCorpus(max_bytes=1)
    held_out.data, corpus.data = corpus.data[-100_000:], corpus.data[:-100_000]
    g = torch.Generator().manual_seed(12345)  # the same evaluation batches on every rank
    evals = [held_out.batch(64, CONV_MODEL["block_size"], g) for _ in range(4)]
    return {label: _train_gpt(t, corpus, evals, kind, lr, extra) for label, kind, lr, extra in CONV_RUNS}


@pytest.mark.slow  # a convergence run: the quick lane leaves it to CI
@pytest.mark.timeout(420)
def test_convergence_gpt_against_uncompressed():
    losses = run_world(_convergence, 2, backend="torch", timeout=400)
    assert losses[0] == losses[1]  # the replicas agree at the end
    loss = losses[0]
    report = ", ".join(f"{k} {v:.4f}" for k, v in loss.items())
    print(f"\nfinal eval loss after {CONV_STEPS} steps (compression from step {CONV_FREEZE + 1}), 2 ranks: {report}")
    for name, base in [("OneBitAdam", "AdamW"), ("ZeroOneAdam", "AdamW"), ("OneBitLamb", "LAMB")]:
        assert loss[name] <= 1.03 * loss[base], f"{name} vs {base}: {report}"
    assert max(loss.values()) < 0.85 * math.log(128), report  # every run learned something
