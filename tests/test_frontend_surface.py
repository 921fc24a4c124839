"""What the Hugging Face Trainer, accelerate and Lightning call on their DeepSpeed paths,
one behaviour at a time (tests/test_frontends.py runs the front-ends themselves):

* ``zpp run``: ``import deepspeed`` gives zpp only there, with a distribution the front-ends'
  version checks accept; a real DeepSpeed beside it is named;
* the accumulation boundary set from outside (accelerate calls ``step()`` only at the
  boundary), ``backward(scale_wrt_gas=False)`` (the Trainer) and its return value;
* the caller's torch optimizer is the engine's: a scheduler built on it before
  ``initialize`` moves the learning rate (torch 2.13's AdamW could not be rebuilt at all);
* the ZeRO-3 export (``_zero3_consolidated_16bit_state_dict``, ``save_16bit_model``),
  ``engine.config``, ``steps_per_print`` of infinity, ``clone_tensors_for_torch_save``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zpp
import zpp.zero as zz
from tests.dist import run_world
from zpp import as_deepspeed
from zpp.checkpoint.utils import clone_tensors_for_torch_save

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, *, via_zpp_run: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code]
    if via_zpp_run:
        cmd = [sys.executable, "-m", "zpp", "run", *cmd]
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", as_deepspeed.ENV)}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), (env or {}).pop("PYTHONPATH", None)]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**base, **(env or {})})


_PROBE = """
import importlib.metadata as md, importlib.util as iu
print("spec", iu.find_spec("deepspeed") is not None)
print("version", md.version("deepspeed"))
from packaging.version import Version
print("checks", Version(md.version("deepspeed")) >= Version("0.16.0"))
import deepspeed, zpp, zpp.zero
import deepspeed.comm, deepspeed.runtime.lr_schedules
print("same", deepspeed.initialize is zpp.initialize, deepspeed.DeepSpeedEngine is zpp.zero.ZeroEngine,
      deepspeed.comm is zpp.comm, deepspeed.comm.__spec__.name, deepspeed.__version__)
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
try:
    import deepspeed.inference
except ImportError as e:
    print("refused", str(e)[:40])
"""


def test_zpp_run_makes_deepspeed_zpp_and_only_there():
    res = _python(_PROBE, via_zpp_run=True)
    assert res.returncode == 0, res.stderr
    want = as_deepspeed.distribution_version()
    assert want == f"0.19.8+zpp.{zpp.__version__}"
    assert res.stdout.splitlines() == [
        "spec True", f"version {want}", "checks True", f"same True True True zpp.comm {want}",
        "refused zpp.inference (deepspeed.inference): Dee"], res.stdout
    # outside zpp run nothing claims to be DeepSpeed
    res = _python("import importlib.util as iu; print(iu.find_spec('deepspeed'))", via_zpp_run=False)
    assert res.returncode == 0 and res.stdout.strip() == "None", (res.stdout, res.stderr)


def test_zpp_run_names_a_real_deepspeed_it_shadows(tmp_path):
    fake = tmp_path / "site"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("raise SystemExit('the real one was imported')\n")
    info = fake / "deepspeed-0.18.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.0\n")
    res = _python("import deepspeed; print(deepspeed.__zpp__)", via_zpp_run=True, env={"PYTHONPATH": str(fake)})
    assert res.returncode == 0 and res.stdout.strip() == "True", (res.stdout, res.stderr)
    assert "not used: DeepSpeed 0.18.0 in" in res.stderr and str(fake) in res.stderr, res.stderr


def test_zpp_run_command_line(capsys):
    from zpp import cli

    assert cli.main(["run", "--path"]) == 0
    assert capsys.readouterr().out.strip() == as_deepspeed.shim_path()
    with pytest.raises(SystemExit) as e:
        cli.main(["run"])
    assert e.value.code == 2 and "no command" in capsys.readouterr().err
    res = subprocess.run([sys.executable, "-m", "zpp", "run", "no-such-command-zpp"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2 and "command not found: 'no-such-command-zpp'" in res.stderr, res.stderr
    env = as_deepspeed.environ({"PYTHONPATH": "/a:" + as_deepspeed.shim_path()})
    assert env["PYTHONPATH"] == as_deepspeed.shim_path() + os.pathsep + "/a" and env[as_deepspeed.ENV] == "1"


# ---------------------------------------------------------------------- the engine's DeepSpeed surface
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)) for _ in range(n)]


def _weights(engine):
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


def _boundary(t):
    """gas 2, 6 micro-batches: DeepSpeed's pattern (step() every micro-batch), accelerate's
    (the boundary set before each backward, step() at the boundary only), and the Trainer's
    (scale_wrt_gas=False with the loss divided by hand) train the same weights."""
    out = {}
    for stage in (0, 2, 3):
        cfg = {"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 3,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        runs = {}
        for pattern in ("deepspeed", "accelerate", "trainer"):
            engine, *_ = zz.initialize(model=_model(), config=cfg, transport=t)
            returned = []
            for i, (x, y) in enumerate(_batches(t.rank, 6)):
                boundary = i % 2 == 1
                loss = torch.nn.functional.mse_loss(engine(x), y)
                if pattern == "accelerate":
                    engine.set_gradient_accumulation_boundary(boundary)
                if pattern == "trainer":
                    returned.append(engine.backward(loss / 2, scale_wrt_gas=False).item() / (loss.item() / 2))
                else:
                    returned.append(engine.backward(loss).item() / loss.item())
                if pattern != "accelerate" or boundary:
                    engine.step()
                    out.setdefault(("applied", stage, pattern), []).append(engine.was_step_applied())
            runs[pattern] = (_weights(engine), engine.global_steps, engine.micro_steps, engine.global_samples,
                             [round(r, 6) for r in returned])
            engine.close()
        ref = runs["deepspeed"]
        out[stage] = {p: (all(torch.equal(r[0][k], ref[0][k]) for k in ref[0]), *r[1:]) for p, r in runs.items()}
    return out


def test_accumulation_boundary_from_outside_and_scale_wrt_gas():
    for r in run_world(_boundary, 2, timeout=120):
        for stage in (0, 2, 3):
            s = r[stage]
            # weights equal to the bit; 3 optimizer steps of 12 samples; micro_steps counts step() calls
            assert s["deepspeed"] == (True, 3, 6, 36, [0.5] * 6), s
            assert s["accelerate"] == (True, 3, 3, 36, [0.5] * 6), s
            assert s["trainer"] == (True, 3, 6, 36, [1.0] * 6), s  # scale_wrt_gas=False: returned as given
            assert r[("applied", stage, "accelerate")] == [True] * 3
            assert r[("applied", stage, "deepspeed")] == [False, True] * 3


def _user_optimizer(t):
    """The caller's AdamW and a LambdaLR built on it before initialize: the engine steps that
    object, the schedule moves its lr, and the training equals torch DDP with the same two."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    lam = lambda s: min(1.0, (s + 1) / 4)  # noqa: E731
    out = {}
    ref = _model()
    ddp = DDP(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    ref_losses, ref_lrs = [], []
    for x, y in _batches(t.rank, 6):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
        ref_lrs.append(opt.param_groups[0]["lr"])
    for stage in (2, 3):
        model = _model()
        user_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        user_sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lam)
        engine, optimizer, _, lr_scheduler = zz.initialize(
            model=model, optimizer=user_opt, lr_scheduler=user_sched, transport=t,
            config={"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                    "steps_per_print": float("inf")})
        losses, lrs = [], []
        for x, y in _batches(t.rank, 6):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()  # steps the schedule too, as DeepSpeed's engine does
            losses.append(loss.item())
            lrs.append(user_opt.param_groups[0]["lr"])
        out[stage] = (optimizer is user_opt, lr_scheduler is user_sched, losses, lrs,
                      engine.train_config.steps_per_print, engine.config["steps_per_print"])
        engine.close()
    out["ref"] = (ref_losses, ref_lrs)
    return out


def test_the_callers_optimizer_and_schedule_drive_the_engine():
    for r in run_world(_user_optimizer, 2, timeout=120):
        ref_losses, ref_lrs = r["ref"]
        for stage in (2, 3):
            same_opt, same_sched, losses, lrs, spp, given = r[stage]
            assert same_opt and same_sched
            assert lrs == ref_lrs and ref_lrs[0] == pytest.approx(5e-3) and ref_lrs[-1] == 1e-2
            assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
            assert spp == 0 and given == float("inf")  # never print, as accelerate means it


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("kept", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.head(self.emb(x))


def _export(t, tmp):
    out = {}
    for stage, gather in ((3, True), (3, False), (2, True)):
        torch.manual_seed(0)
        model = _Tied()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.0}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                     "stage3_gather_16bit_weights_on_model_save": gather}}
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        key = (stage, gather)
        out[key] = {"flag": engine.zero_gather_16bit_weights_on_model_save(), "config": engine.config == cfg}
        if stage == 3:
            sd = engine._zero3_consolidated_16bit_state_dict()
            out[key]["sd"] = None if sd is None else (
                sorted(sd), sd["head.weight"] is sd["emb.weight"], all(torch.equal(sd[k], want[k]) for k in want))
        else:
            try:
                engine._zero3_consolidated_16bit_state_dict()
            except ValueError as e:
                out[key]["sd"] = str(e)
        folder = os.path.join(tmp, f"s{stage}{gather}")
        out[key]["saved"] = engine.save_16bit_model(folder, "model.bin")
        path = os.path.join(folder, "model.bin")
        if t.rank == 0 and os.path.exists(path):
            fresh = _Tied()
            fresh.load_state_dict(torch.load(path))
            out[key]["loaded"] = all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
        engine.close()
    return out


def test_zero3_export_for_save_model(tmp_path):
    r0, r1 = run_world(_export, 2, args=(str(tmp_path),), timeout=120)
    keys = ["emb.weight", "head.weight", "kept"]  # no non-persistent buffer, tied names both there
    assert r0[(3, True)] == {"flag": True, "config": True, "sd": (keys, True, True), "saved": True, "loaded": True}
    assert r1[(3, True)] == {"flag": True, "config": True, "sd": None, "saved": True}  # rank 0 holds it
    # the flag off at ZeRO-3: DeepSpeed's save_16bit_model writes nothing and says False
    assert r0[(3, False)]["saved"] is False and "loaded" not in r0[(3, False)]
    assert r0[(2, True)]["saved"] is True and r0[(2, True)]["loaded"] is True
    assert "requires ZeRO-3" in r0[(2, True)]["sd"]


def test_clone_tensors_for_torch_save():
    big = torch.arange(1000.0)
    item = {"a": big[:3], "b": [big[3:5], (big[5:6], "text")], "c": 7}
    out = clone_tensors_for_torch_save(item)
    assert out["c"] == 7 and out["b"][1][1] == "text" and isinstance(out["b"][1], tuple)
    assert torch.equal(out["a"], big[:3]) and out["a"].untyped_storage().nbytes() == 12  # the values only
    out["a"][0] = -1.0
    assert big[0] == 0.0  # a copy, not a view
