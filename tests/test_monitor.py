"""DeepSpeed's monitors (:mod:`zpp.zero.monitor`): the files, events and ranks of
DeepSpeed 0.19.8, and a missing package never stops a run.

* csv_monitor over 2 gloo ranks, fp16 with a skipped step: the directory, file names,
  headers and rows DeepSpeed writes ("Train/Samples/lr" and "Train/Samples/loss_scale" after
  each boundary step at ``global_samples``; the first scale an int, as DeepSpeed's, then
  a float once halved), a script's own events through ``engine.monitor.write_events``,
  nothing at backward, nothing from rank 1.
* tensorboard enabled with its package made unimportable: one warning on rank 0 naming the
  package and the pip command, over two engines; training and the csv files go on.
* tensorboard, wandb and comet against stand-in modules (the calls DeepSpeed makes; comet's
  samples_log_interval); a writer that raises warns once; a rerun appends a second header.
* the config: typed values, unknown keys and bad values named.
"""
import json
import sys
import types
import warnings

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from zpp.zero import monitor
from zpp.zero.monitor import MonitorConfig, MonitorMaster

LRS = (1e-3, 2e-3, 3e-3, 4e-3)  # set by the script before each optimizer step
SKIPPED = 2  # the optimizer step (from 0) whose gradients hold Inf on rank 1


def _config(out, job, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Adam", "params": {"lr": LRS[0]}}, "zero_optimization": {"stage": 2},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": job}, **extra}


def _train(t, cfg, steps, *, overflow_step=None):
    """Train ``steps`` optimizer steps of 2 micro-steps; rank 0 logs its own loss through
    engine.monitor at each boundary, as a script would. Returns the engine and, per step,
    (global_samples, lr set, loss logged)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    g = torch.Generator().manual_seed(10 + t.rank)
    seen = []
    for step in range(steps):
        for g_ in engine.optimizer.param_groups:
            g_["lr"] = LRS[step]
        for micro in range(2):
            loss = engine(torch.randn(2, 4, generator=g)).float().pow(2).mean()
            if step == overflow_step and micro == 0 and t.rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        engine.monitor.write_events([("Train/Samples/train_loss", loss.item(), engine.global_samples)])
        seen.append((engine.global_samples, LRS[step], loss.item()))
    return engine, seen


def _world(t, out):
    res = {}
    fp16 = {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, seen = _train(t, _config(out, "job", **fp16), 4, overflow_step=SKIPPED)
    engine.monitor.write_events([("eval accuracy", 0.5, engine.global_samples)])
    res["csv"] = dict(enabled=engine.monitor.enabled, writers=sorted(engine.monitor.writers), seen=seen,
                      skipped=engine.skipped_steps, scale=engine.loss_scale())
    engine.close()

    saved = {k: sys.modules.get(k) for k in ("tensorboard", "torch.utils.tensorboard")}
    for k in saved:
        sys.modules[k] = None  # import fails: the package "is not installed"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs = []
            for _ in range(2):  # two engines, one warning
                engine, seen = _train(t, _config(out, "tb", tensorboard={"enabled": True, "output_path": out}), 2)
                runs.append((sorted(engine.monitor.writers), seen, engine.global_steps))
                engine.close()
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    res["tb"] = dict(runs=runs, warnings=[str(w.message) for w in caught if w.category is RuntimeWarning])
    return res


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor")
    return out, run_world(_world, 2, args=(str(out),), timeout=150)


def _rows(path):
    return path.read_bytes().decode().split("\r\n")


@pytest.mark.timeout(180)
def test_csv_monitor_writes_deepspeeds_files(world):
    out, (r0, r1) = world
    job = out / "job"
    assert sorted(p.name for p in job.iterdir()) == [
        "Train_Samples_loss_scale.csv", "Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "eval_accuracy.csv"]
    # the engine's events: after each boundary step, at global_samples (train_batch_size 8 per step)
    assert _rows(job / "Train_Samples_lr.csv") == ["step,lr", "8,0.001", "16,0.002", "24,0.003", "32,0.004", ""]
    # fp16: DeepSpeed's first scale is the int 2**8; the skipped step halves it (hysteresis 1) to a float
    assert _rows(job / "Train_Samples_loss_scale.csv") == ["step,loss_scale", "8,256", "16,256", "24,128.0",
                                                            "32,128.0", ""]
    assert r0["csv"]["skipped"] == r1["csv"]["skipped"] == 1 and r0["csv"]["scale"] == 128.0
    # the script's own events: rank 0's values, as it computed them
    seen = r0["csv"]["seen"]
    assert [s for s, _, _ in seen] == [8, 16, 24, 32]
    assert _rows(job / "Train_Samples_train_loss.csv") == ["step,train_loss"] + [
        f"{s},{loss!r}" for s, _, loss in seen] + [""]
    assert _rows(job / "eval_accuracy.csv") == ["step,eval accuracy", "32,0.5", ""]
    # rank 0 writes, rank 1 has no writer (the rows above are not doubled); enabled on both
    assert r0["csv"]["enabled"] and r1["csv"]["enabled"]
    assert (r0["csv"]["writers"], r1["csv"]["writers"]) == (["csv_monitor"], [])


@pytest.mark.timeout(180)
def test_tensorboard_missing_warns_once_and_training_goes_on(world):
    out, (r0, r1) = world
    (w,) = r0["tb"]["warnings"]
    assert "'tensorboard' package" in w and "`pip install tensorboard`" in w
    assert r1["tb"]["warnings"] == []
    for writers, seen, steps in r0["tb"]["runs"]:
        assert writers == ["csv_monitor"] and steps == 2 and [s for s, _, _ in seen] == [8, 16]
    # two engines, same directory: each run adds its header, as DeepSpeed's
    assert _rows(out / "tb" / "Train_Samples_lr.csv") == ["step,lr", "8,0.001", "16,0.002"] * 2 + [""]
    assert sorted(p.name for p in (out / "tb").iterdir()) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    assert not (out / "DeepSpeedJobName").exists()  # the tensorboard writer made nothing


# ---------------------------------------------------------------------- writers, in process
class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))


@pytest.fixture()
def fresh(monkeypatch):
    monkeypatch.setattr(monitor, "_WARNED", set())


def _fake_packages(monkeypatch, comet_version="3.47.0"):
    rec = {"tb": _Recorder(), "wandb": _Recorder(), "comet": _Recorder()}

    class SummaryWriter:
        def __init__(self, log_dir):
            rec["tb"].log_dir = log_dir

        def __getattr__(self, name):
            return getattr(rec["tb"], name)

    def start(**kw):
        rec["comet"].start = kw
        return rec["comet"]

    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = SummaryWriter
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: rec["wandb"].calls.append(("init", (), kw))
    wandb.log = lambda data, step=None: rec["wandb"].calls.append(("log", (data,), {"step": step}))
    comet = types.ModuleType("comet_ml")
    comet.__version__, comet.start = comet_version, start
    for name, mod in (("torch.utils.tensorboard", tb), ("wandb", wandb), ("comet_ml", comet)):
        monkeypatch.setitem(sys.modules, name, mod)
    return rec


def test_tensorboard_wandb_comet_calls(monkeypatch, tmp_path, fresh):
    rec = _fake_packages(monkeypatch)
    cfg = MonitorConfig(tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
                        wandb={"enabled": True, "team": "t", "group": "g"},
                        comet={"enabled": True, "samples_log_interval": 10, "experiment_name": "run1",
                               "api_key": "secret", "online": False})
    assert "secret" not in repr(cfg)
    assert MonitorMaster(cfg, rank=1).writers == {} and rec["wandb"].calls == []  # rank 1: nothing built
    m = MonitorMaster(cfg, rank=0)
    assert list(m.writers) == ["tensorboard", "wandb", "comet"] and m.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (0, 5, 10, 12, 25):
            m.write_events([("Train/Samples/lr", step / 100, step)])
    assert rec["tb"].log_dir == str(tmp_path / "tb") and (tmp_path / "tb").is_dir()
    adds = [c for c in rec["tb"].calls if c[0] == "add_scalar"]
    assert [c[1] for c in adds] == [("Train/Samples/lr", s / 100, s) for s in (0, 5, 10, 12, 25)]
    assert [c[0] for c in rec["tb"].calls].count("flush") == 5  # after each write_events
    assert rec["wandb"].calls[0] == ("init", (), {"project": "deepspeed", "group": "g", "entity": "t"})
    assert rec["wandb"].calls[1:] == [("log", ({"Train/Samples/lr": s / 100},), {"step": s})
                                      for s in (0, 5, 10, 12, 25)]
    assert rec["comet"].start == {"api_key": "secret", "project": None, "workspace": None, "experiment_key": None,
                                  "mode": None, "online": False}
    assert rec["comet"].calls[0] == ("set_name", ("run1",), {})
    # logged when new, then once the step moved samples_log_interval past the last logged one
    assert [c[2]["step"] for c in rec["comet"].calls[1:]] == [0, 10, 25]


def test_missing_or_failing_writers_warn_once(monkeypatch, tmp_path, fresh):
    rec = _fake_packages(monkeypatch, comet_version="3.40.2")
    sys.modules["wandb"].log = lambda data, step=None: 1 / 0
    cfg = MonitorConfig(csv_monitor={"enabled": True, "output_path": str(tmp_path)}, wandb={"enabled": True},
                        comet={"enabled": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            m = MonitorMaster(cfg, rank=0)
            m.write_events([("a/b", 1, 8)])
            m.write_events([("a/b", 2, 16)])
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 2, msgs
    assert "'comet_ml' package" in msgs[0] and 'pip install "comet_ml>=3.41.0"' in msgs[0] and "3.40.2" in msgs[0]
    assert "'wandb' monitor failed to write (ZeroDivisionError" in msgs[1]
    assert rec["comet"].calls == []
    # the csv writer went on; the second monitor appended its own header, as DeepSpeed's does
    rows = (tmp_path / "DeepSpeedJobName" / "a_b.csv").read_text().splitlines()
    assert rows == ["step,b", "8,1", "16,2"] * 2


def test_disabled_monitor_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = MonitorMaster(MonitorConfig(csv_monitor={"output_path": "x"}), rank=0)
    m.write_events([("a", 1, 1)])
    assert not m.enabled and m.writers == {} and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- config
def test_config_translation():
    cfg = zz.from_deepspeed({"tensorboard": {"enabled": True, "output_path": "", "job_name": "j"},
                             "csv_monitor": {"enabled": False}, "wandb": {"enabled": True, "group": None},
                             "comet": {"enabled": True, "samples_log_interval": 1e3, "mode": "get_or_create"}})
    mon = cfg.monitor
    assert mon.enabled and mon.tensorboard == monitor.TensorBoardConfig(enabled=True, job_name="j")
    assert mon.csv_monitor == monitor.CSVConfig() and mon.wandb == monitor.WandbConfig(enabled=True)
    assert mon.comet.samples_log_interval == 1000 and isinstance(mon.comet.samples_log_interval, int)
    assert not zz.from_deepspeed({}).monitor.enabled
    # the typed path takes dicts too
    assert zz.TrainConfig(monitor=MonitorConfig(csv_monitor={"enabled": True})).monitor.csv_monitor.enabled


@pytest.mark.parametrize("ds,words", [
    ({"tensorboard": {"enabled": True, "outptu_path": "runs"}}, ["'tensorboard'", "outptu_path"]),
    ({"csv_monitor": {"enabled": "true"}}, ["csv_monitor.enabled='true'"]),
    ({"csv_monitor": {"output_path": 3}}, ["csv_monitor.output_path=3", "a string"]),
    ({"wandb": {"project": None}}, ["wandb.project=None"]),
    ({"wandb": {"team": ""}}, ["wandb.team=''"]),
    ({"comet": {"mode": "sometimes"}}, ["comet.mode='sometimes'", "get_or_create"]),
    ({"comet": {"samples_log_interval": -1}}, ["comet.samples_log_interval=-1"]),
    ({"comet": {"online": 1}}, ["comet.online=1"]),
    ({"comet": []}, ["comet=[]"]),
])
def test_config_errors_name_the_key(ds, words):
    with pytest.raises(ValueError) as e:
        zz.from_deepspeed(json.loads(json.dumps(ds)))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_typed_config_errors():
    with pytest.raises(ValueError, match=r"unknown keys in 'comet': \['colour'\]"):
        MonitorConfig(comet={"colour": "red"})
    with pytest.raises(ValueError, match="TensorBoardConfig: enabled=1"):
        monitor.TensorBoardConfig(enabled=1)
    with pytest.raises(ValueError, match="MonitorConfig: wandb=3"):
        MonitorConfig(wandb=3)
