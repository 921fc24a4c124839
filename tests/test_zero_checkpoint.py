"""Sharded checkpoints: save -> load -> continue gives the losses of not stopping, a 4-rank
(2 nodes x 2) checkpoint reshards onto 2 ranks exactly (weights and Adam state) and trains
on there as plain torch AdamW from the saved state does, and DeepSpeed's arguments
(client_state, save_latest, exclude_frozen_parameters, the load flags, the return values) do
what DeepSpeed's do. Faults: tests/test_faults_checkpoint.py."""
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, GPTConfig
from tests.test_zero_engine import OddNet
from zpp.zero.checkpoint.load import read_parameters


def _model(kind, seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)) if kind == "gpt" else OddNet()


def _batch(kind, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "gpt":
        x = torch.randint(0, 128, (4, 16), generator=g)
        return x, x
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def _cfg(stage, gas=1, bf16=False):
    return {
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_num_steps": 3, "warmup_max_lr": 5e-3, "total_num_steps": 20}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
    }


def _train(engine, kind, rank, steps):
    losses = []
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(*_batch(kind, rank, 10 * step + micro))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _save_and_continue(t, root):
    out = {}
    for kind, stage, gas, bf16 in [("gpt", 3, 1, False), ("odd", 1, 2, True), ("odd", 3, 1, False)]:
        name = f"{kind}-s{stage}-gas{gas}-{'bf16' if bf16 else 'fp32'}"
        cfg = _cfg(stage, gas, bf16)
        e1, *_ = zz.initialize(model=_model(kind, 0), config=cfg, transport=t)
        _train(e1, kind, t.rank, range(3))
        e1.save_checkpoint(f"{root}/{name}")
        if t.rank == 0:
            torch.save(e1.consolidated_state_dict(), f"{root}/{name}/consolidated.pt")
        else:
            e1.consolidated_state_dict()
        straight = _train(e1, kind, t.rank, range(3, 6))
        e1.close()
        e2, *_ = zz.initialize(model=_model(kind, 99), config=cfg, transport=t)  # other init
        e2.load_checkpoint(f"{root}/{name}")
        assert e2.global_steps == 3
        resumed = _train(e2, kind, t.rank, range(3, 6))
        out[name] = (straight, resumed)
        e2.close()
    return out


RESUMED_STEPS = range(3, 6)


def _reshard(t, root):
    """Load the 4-rank stage-3 checkpoint on 2 ranks (stage 3 and stage 1), save it again,
    train on; per stage, this rank's losses and the weights at the end."""
    name = "gpt-s3-gas1-fp32"
    want = torch.load(f"{root}/{name}/consolidated.pt")
    out = {}
    for stage in (3, 1):
        e, *_ = zz.initialize(model=_model("gpt", 7), config=_cfg(stage), transport=t)
        e.load_checkpoint(f"{root}/{name}")
        got = e.consolidated_state_dict()
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        e.save_checkpoint(f"{root}/resharded-s{stage}")
        losses = _train(e, "gpt", t.rank, RESUMED_STEPS)
        out[stage] = (losses, e.consolidated_state_dict())
        e.close()
    return out


def _lr(step):
    """_cfg's WarmupDecayLR written out (DeepSpeed's formula): log warm-up over 3 steps to
    5e-3, then linear decay to 0 at step 20; optimizer step ``step`` runs at iteration
    ``step - 1`` (0 before the first; see [Note: which lr a step uses] in
    zpp/zero/schedule_base.py)."""
    t = step - 1
    if t < 0:
        return 0.0
    return 5e-3 * (math.log(t + 1) / math.log(3) if t < 3 else (20 - t) / 17)


def _reference_continuation(root, name, world):
    """What training on from the checkpoint must give, in plain torch in this process: the
    checkpoint's weights (the 4-rank run's consolidated state) and Adam moments and step,
    ``world`` ranks' batches, the mean of their gradients, ``clip_grad_norm_(1.0)`` and
    ``torch.optim.AdamW`` (DeepSpeed's "Adam" with weight decay) at :func:`_lr`. Returns
    each rank's losses and the final state dict."""
    model = _model("gpt", 0)
    model.load_state_dict(torch.load(f"{root}/{name}/consolidated.pt"))
    saved = read_parameters(Path(root, name, "global_step3"))
    params = dict(model.named_parameters())
    assert sorted(saved) == sorted(params), (sorted(saved), sorted(params))
    opt = torch.optim.AdamW(list(params.values()), lr=_lr(3), weight_decay=0.01, foreach=False)
    for n, p in params.items():
        assert torch.equal(saved[n]["values"].view_as(p), p.detach()), n
        opt.state[p] = {"step": torch.tensor(float(saved[n]["step"])),
                        "exp_avg": saved[n]["exp_avg"].view_as(p).clone(),
                        "exp_avg_sq": saved[n]["exp_avg_sq"].view_as(p).clone()}
    losses = [[] for _ in range(world)]
    for step in RESUMED_STEPS:
        grads = []
        for rank in range(world):
            model.zero_grad()
            loss = model(*_batch("gpt", rank, 10 * step))
            loss.backward()
            losses[rank].append(loss.item())
            grads.append([p.grad.clone() for p in params.values()])
        for i, p in enumerate(params.values()):
            p.grad = sum(g[i] for g in grads) / world
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(600)  # two worlds of up to 290 s each (see tests.dist.world_timeout)
def test_save_load_continue_and_reshard(tmp_path):
    root = str(tmp_path)
    results = run_world(_save_and_continue, 4, ranks_per_node=2, args=(root,), timeout=290)
    for rank, res in enumerate(results):
        for name, (straight, resumed) in res.items():
            assert straight == resumed, (rank, name, straight, resumed)
    meta = json.loads(Path(root, "gpt-s3-gas1-fp32", "global_step3", "meta.json").read_text())
    assert meta["world_size"] == 4 and meta["global_steps"] == 3
    assert Path(root, "gpt-s3-gas1-fp32", "latest").read_text() == "global_step3"
    assert not list(Path(root).rglob(".*.tmp*")) and not list(Path(root).rglob(".zpp-*"))  # nothing left behind
    resumed = run_world(_reshard, 2, args=(root,), timeout=290)
    # training on after the reshard is the plain-torch continuation of the saved state
    ref_losses, ref_state = _reference_continuation(root, "gpt-s3-gas1-fp32", 2)
    for stage in (3, 1):
        for rank in range(2):
            losses, state = resumed[rank][stage]
            torch.testing.assert_close(losses, ref_losses[rank], rtol=2e-5, atol=0,
                                       msg=lambda m, s=stage, r=rank: f"stage {s} rank {r} losses: {m}")
            assert list(state) == list(ref_state)
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], rtol=0, atol=2e-5,
                                           msg=lambda m, s=stage, k=k: f"stage {s} {k}: {m}")
    # the 2-rank re-save holds exactly what the 4-rank checkpoint held, by parameter
    a = read_parameters(Path(root, "gpt-s3-gas1-fp32", "global_step3"))
    for stage in (3, 1):
        b = read_parameters(Path(root, f"resharded-s{stage}", "global_step3"))
        assert sorted(a) == sorted(b)
        for n in a:
            assert sorted(a[n]) == sorted(b[n]) == ["exp_avg", "exp_avg_sq", "step", "values"], (n, sorted(b[n]))
            for k in a[n]:
                assert torch.equal(a[n][k], b[n][k]), (stage, n, k)


# ---------------------------------------------------------------------- DeepSpeed's arguments (2 ranks)
@dataclasses.dataclass
class Marker:
    """A user object in client_state (pickled by name)."""

    n: int


class OddNetPlus(OddNet):
    """OddNet with one more parameter (for load_module_strict)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.full((2,), 0.5))

    def forward(self, x, y):
        return super().forward(x, y) + 0.1 * self.extra.sum()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _client(rank):
    return {"epoch": 3, "rng": torch.Generator().manual_seed(5).get_state(), "pair": (1, "b"),
            "nested": {"a": [1, 2.5, "x", None], "t": torch.arange(5, dtype=torch.int16)}, "obj": Marker(7),
            "saved_by": rank}


def _params(e, names=None):
    sd = e.consolidated_state_dict()
    return {k: v for k, v in sd.items() if names is None or k in names}


def _errors(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__, str(e)
    return None


def _deepspeed_args(t, root):
    import warnings

    root = Path(root)
    out = {}
    cfg = _cfg(3)
    e1, *_ = zz.initialize(model=_model("odd", 0), config=cfg, transport=t)
    _train(e1, "odd", t.rank, range(3))
    out["save_returns"] = e1.save_checkpoint(root, client_state=_client(t.rank))
    want = _params(e1)
    lr_at_save = e1.get_lr()
    straight = _train(e1, "odd", t.rank, range(3, 5))

    def fresh(model=None):
        e, *_ = zz.initialize(model=model or _model("odd", 99), config=cfg, transport=t)
        return e

    # default load: path, rank 0's client_state on every rank, exact continuation
    e = fresh()
    path, client = e.load_checkpoint(root)
    out["load"] = (path == str(root / "global_step3"), _same(client, _client(0)),
                   _train(e, "odd", t.rank, range(3, 5)) == straight)
    # nothing to load: (None, None) with a warning on rank 0; a missing tag directory raises
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out["no_latest"] = (e.load_checkpoint(root / "empty"), [str(w.message) for w in seen])
    out["no_tag"] = _errors(lambda: e.load_checkpoint(root, tag="nope"))
    # load_module_only: weights and buffers; optimizer, schedule and counters as they were
    e = fresh()
    lr0, sched0 = e.get_lr(), e.lr_scheduler.state_dict()
    _, client = e.load_checkpoint(root, load_module_only=True)
    ref_model = _model("odd", 99)
    ref_model.load_state_dict(want)
    ref = fresh(ref_model)
    out["module_only"] = (_same(_params(e), want), e.global_steps, len(e.optimizer.state), e.get_lr() == lr0,
                          e.lr_scheduler.state_dict() == sched0, _same(client, _client(0)),
                          _train(e, "odd", t.rank, range(3, 5)) == _train(ref, "odd", t.rank, range(3, 5)))
    # load_optimizer_states=False: weights, schedule, counters; optimizer state as it was (fresh)
    e = fresh()
    e.load_checkpoint(root, load_optimizer_states=False)
    out["no_optimizer"] = (_same(_params(e), want), e.global_steps, len(e.optimizer.state), e.get_lr() == lr_at_save)
    # load_lr_scheduler_states=False: the schedule as it was; the optimizer state loaded
    e = fresh()
    sched0 = e.lr_scheduler.state_dict()
    e.load_checkpoint(root, load_lr_scheduler_states=False)
    out["no_scheduler"] = (e.lr_scheduler.state_dict() == sched0, e.global_steps, len(e.optimizer.state) > 0)
    # load_module_strict: a model with one more parameter
    e = fresh(OddNetPlus())
    before = _params(e)
    out["strict_missing"] = (_errors(lambda: e.load_checkpoint(root)), _same(_params(e), before))
    e.load_checkpoint(root, load_module_strict=False)
    got = _params(e)
    out["lenient_missing"] = (_same({k: v for k, v in got.items() if k != "extra"}, want),
                              torch.equal(got["extra"], torch.full((2,), 0.5)), e.global_steps)
    e.save_checkpoint(root / "plus")
    e = fresh()
    out["strict_unexpected"] = _errors(lambda: e.load_checkpoint(root / "plus"))
    e.load_checkpoint(root / "plus", load_module_strict=False)
    out["lenient_unexpected"] = _same(_params(e), want)
    # exclude_frozen_parameters: the frozen layer stays out; the loading model keeps its own
    e1.load_checkpoint(root)  # back to step 3
    e1.save_checkpoint(root / "nofrozen", exclude_frozen_parameters=True)
    e = fresh()
    own_frozen = _params(e, {"frozen.weight", "frozen.bias"})
    e.load_checkpoint(root / "nofrozen")
    got = _params(e)
    out["exclude_frozen"] = (_same({k: v for k, v in got.items() if not k.startswith("frozen.")},
                                   {k: v for k, v in want.items() if not k.startswith("frozen.")}),
                             _same({k: got[k] for k in own_frozen}, own_frozen),
                             not _same(own_frozen, {k: want[k] for k in own_frozen}))
    # ZPP_CHECKPOINT_FSYNC=0: no fsync at all (with the default: one per file and directory)
    real_fsync, calls = os.fsync, []
    os.fsync = lambda fd: calls.append(fd) or real_fsync(fd)
    try:
        e1.save_checkpoint(root / "sync")
        synced = len(calls)
        os.environ["ZPP_CHECKPOINT_FSYNC"] = "0"
        e1.save_checkpoint(root / "nosync")
        del os.environ["ZPP_CHECKPOINT_FSYNC"]
    finally:
        os.fsync = real_fsync
    out["fsyncs"] = (synced, len(calls) - synced)
    e = fresh()
    e.load_checkpoint(root / "nosync")
    out["nosync_loads"] = _same(_params(e), want)
    # save_latest=False; bad tags and client_state, on every rank, leaving nothing behind
    e1.save_checkpoint(root, tag="side", save_latest=False)
    out["latest_kept"] = (root / "latest").read_text()
    out["tags_differ"] = _errors(lambda: e1.save_checkpoint(root, tag=f"r{t.rank}"))
    out["bad_tag"] = _errors(lambda: e1.save_checkpoint(root, tag="a/b"))
    out["bad_client"] = _errors(lambda: e1.save_checkpoint(root, client_state=[1] if t.rank == 0 else {}))
    t.barrier()
    out["entries"] = sorted(p.name for p in root.iterdir())
    return out


def test_deepspeed_arguments(tmp_path):
    results = run_world(_deepspeed_args, 2, args=(str(tmp_path),), timeout=240)
    for rank, res in enumerate(results):
        assert res["save_returns"] is True
        assert res["load"] == (True, True, True), (rank, res["load"])
        (got, warned) = res["no_latest"]
        assert got == (None, None), (rank, got)
        assert (len(warned) == 1 and "no tag given" in warned[0]) if rank == 0 else not warned, (rank, warned)
        kind, msg = res["no_tag"]
        assert kind == "FileNotFoundError" and "'nope'" in msg and str(tmp_path / "nope") in msg, (rank, msg)
        assert res["module_only"] == (True, 0, 0, True, True, True, True), (rank, res["module_only"])
        assert res["no_optimizer"] == (True, 3, 0, True), (rank, res["no_optimizer"])
        assert res["no_scheduler"] == (True, 3, True), (rank, res["no_scheduler"])
        (kind, msg), untouched = res["strict_missing"]
        assert kind == "ValueError" and "missing ['extra']" in msg and "load_module_strict=False" in msg, msg
        assert untouched, rank
        assert res["lenient_missing"] == (True, True, 3), (rank, res["lenient_missing"])
        kind, msg = res["strict_unexpected"]
        assert kind == "ValueError" and "unexpected ['extra']" in msg, msg
        assert res["lenient_unexpected"], rank
        assert res["exclude_frozen"] == (True, True, True), (rank, res["exclude_frozen"])
        assert res["latest_kept"] == "global_step3", rank
        # rank 0: shard, meta.pt, client_state.pt, meta.json, staging dir, save_dir x2, latest; others: shard
        assert res["fsyncs"] == ((8, 0) if rank == 0 else (1, 0)) and res["nosync_loads"], (rank, res["fsyncs"])
        kind, msg = res["tags_differ"]
        assert kind == "ValueError" and "['r0', 'r1']" in msg, msg
        kind, msg = res["bad_tag"]
        assert kind == "ValueError" and "'a/b'" in msg, msg
        kind, msg = res["bad_client"]
        assert kind == "TypeError" and "client_state must be a dict" in msg and "[on rank 0 of 2]" in msg, msg
        assert res["entries"] == ["global_step3", "latest", "nofrozen", "nosync", "plus", "side", "sync"], \
            (rank, res["entries"])
    meta = json.loads((tmp_path / "nofrozen" / "global_step3" / "meta.json").read_text())
    assert meta["excluded_frozen"] == ["frozen.weight", "frozen.bias"], meta["excluded_frozen"]
    assert not any(n.startswith("frozen.") for n in read_parameters(tmp_path / "nofrozen" / "global_step3"))


class _CountingSGD(torch.optim.SGD):
    """A client optimizer with per-tensor state beside the per-element momentum: a Python int
    and a one-element tensor per parameter (as DeepSpeed's hybrid-state test optimizer)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1
                st["tstep"] = st.get("tstep", torch.zeros(1)) + 0.5
        return out


def _per_tensor_state(t, root, stage):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 11), torch.nn.Linear(11, 3))
        opt = _CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
        return zz.initialize(model=model, optimizer=opt, config=cfg, transport=t)[0]

    engine = build()
    for step in range(3):
        engine.backward(engine(torch.randn(2, 10, generator=torch.Generator().manual_seed(step))).sum())
        engine.step()
    engine.save_checkpoint(root, tag="t")
    want = [dict(s) for s in engine.optimizer.state.values()]
    engine.close()
    fresh = build()
    fresh.load_checkpoint(root, tag="t")
    got = [dict(s) for s in fresh.optimizer.state.values()]
    fresh.close()
    return want, got


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_client_optimizer_per_tensor_state_round_trip(tmp_path, stage):
    for want, got in run_world(_per_tensor_state, 2, args=(str(tmp_path), stage), timeout=120):
        assert len(want) == len(got) > 0
        for a, b in zip(want, got):
            assert sorted(a) == sorted(b) == ["count", "momentum_buffer", "tstep"]
            assert a["count"] == b["count"] == 3 and torch.equal(a["tstep"], b["tstep"]) and a["tstep"].shape == (1,)
            assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
