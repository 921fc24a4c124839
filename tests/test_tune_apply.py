"""A ``zpp tune`` plan applied to a job: ``zpp.initialize`` takes the plan's ZeRO++ code
widths (the engine's wire bytes change as the plan predicts), refuses a configured width or
a world that contradicts it, and an override of the plan's backend warns and shows in
``world.chosen_by``; ``zpp cluster run`` exports ``ZPP_COMM_BACKEND`` only for ``--backend``.

The plans are small hand-written files (see [Note: plan file] in zpp/comm/plan.py). The
multi-process checks run on 2 gloo ranks as 2 nodes x 1, so every byte is inter-node and the
expected bytes follow from the collectives' formats (zpp.quant's sizes), not measurements.
"""
from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from zpp.cluster.launch import launch_backend
from zpp.comm import registry
from zpp.comm.collectives import effective_group_size
from zpp.comm.plan import TUNE_FILE_ENV, TunePlan
from zpp.quant import quantized_nbytes, reduce_scatter_chunk
from zpp.zero.comm_api import Phase
from zpp.zero.config import from_deepspeed
from zpp.zero.plan_bits import plan_bits

W, RPN = 2, 1
GROUP = 256
GATHER_CUT = 32 << 10  # the plan gathers below 32 KiB plain, above it in int8
STEPS = 2
EXCLUDED = {"backend": "torch", "op": "reduce_scatter", "compress": "int4", "reason": "maxrelerr > 0.01",
            "sizes": 3, "maxrelerr": 0.031}


def _entry(op, lo, hi, backend, compress):
    return {"op": op, "min_bytes": lo, "max_bytes": hi, "backend": backend, "compress": compress}


def plan_doc(backend="torch", size=W, rpn=RPN):
    """all_gather: plain below GATHER_CUT, int8 above; reduce_scatter: int8 at every size
    (int4 excluded, as ``zpp tune`` records it in meta); all_reduce: plain."""
    entries = [_entry("all_gather", 0, GATHER_CUT, backend, "none"),
               _entry("all_gather", GATHER_CUT, None, backend, "int8"),
               _entry("reduce_scatter", 0, None, backend, "int8"),
               _entry("all_reduce", 0, None, backend, "none")]
    return {
        "version": 1, "world": {"size": size, "ranks_per_node": rpn}, "max_error": 0.01,
        "group_size": GROUP, "backends": [backend], "entries": entries, "by_backend": {backend: entries},
        "meta": {"excluded": [dict(EXCLUDED, backend=backend)]},
    }


def _model():
    torch.manual_seed(0)
    # three units (zpp.unit_min_numel 0): 2.1K, 16.6K and 1K parameters; only the middle
    # one's gather (66 KiB in fp32) is above GATHER_CUT
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 4))


def _config(**zpp):
    return {"train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "zero_quantized_weights": True, "zero_quantized_gradients": True},
            "zpp": {"unit_min_numel": 0, "weight_group_size": GROUP, "gradient_group_size": GROUP, **zpp}}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(t, config):
    """Bytes per counter key over STEPS steps, the engine's units (shard numel, padded numel,
    gather bytes) and its strategies' per-size bits; rank 0's zpp.zero log lines."""
    handler = _Lines()
    logging.getLogger("zpp.zero").addHandler(handler)
    try:
        engine, *_ = zz.initialize(model=_model(), config=config, transport=t)
    finally:
        logging.getLogger("zpp.zero").removeHandler(handler)
    g = torch.Generator().manual_seed(t.rank)
    t.counters.reset()
    for _ in range(STEPS):
        x = torch.randn(4, 32, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    out = {
        "bytes": {k: (v.calls, v.inter_bytes, v.intra_bytes) for k, v in t.counters.snapshot().items()},
        "units": [(u.layout.shard_numel, u.layout.padded_numel) for u in engine.units],
        "gather_bits": dict(engine.comms.gathers[Phase.FORWARD].by_nbytes),
        "reduce_bits": dict(engine.comms.reduce.by_nbytes),
        "log": handler.lines,
        "loss": loss.item(),
    }
    engine.close()
    return out


def _error(t, config, transport=True):
    try:
        zz.initialize(model=_model(), config=config, **({"transport": t} if transport else {}))
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _world(t, paths):
    assert t.world_size == W
    out = {"plain": _train(t, _config()), "plan": _train(t, _config(tune_plan=paths["plan"]))}
    # a configured width that contradicts the plan; one that agrees
    out["conflict"] = _error(t, _config(tune_plan=paths["plan"], gradient_bits=4))
    out["agrees"] = _error(t, _config(tune_plan=paths["plan"], gradient_bits=8, weight_bits=8))
    # plans for other worlds
    out["other_size"] = _error(t, _config(tune_plan=paths["size4"]))
    out["other_rpn"] = _error(t, _config(tune_plan=paths["rpn2"]))
    # the plan chose mpi; the job's transport is torch: it wins, and says so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zz.initialize(model=_model(), config=_config(tune_plan=paths["mpi"]), transport=t)
    out["override_warnings"] = [str(w.message) for w in caught if "overrides the tune plan" in str(w.message)]
    out["chosen_by"] = t.chosen_by
    out["mpi_plan_bits"] = dict(engine.comms.reduce.by_nbytes)  # no torch entries: the plan's overall choice
    engine.close()
    return out


def _expected(units, *, gather_bits, reduce_bits):
    """Inter-node bytes per key over STEPS steps on 2 nodes x 1 rank, from the formats:

    * a quantized all-gather sends this rank's codes and fp32 scales to the one peer;
    * a plain all-gather sends the fp32 shard to it (the backward gathers, and the forward
      gathers the plan sends plain);
    * the quantized reduce-scatter (one rank per node: only the inter-node hop) quantizes
      ``nodes * chunk`` elements and sends the other node's half of codes and scales."""
    qag = ag = qrs = 0
    for shard, padded in units:
        g_bits = gather_bits.get(padded * 4, 8)
        if g_bits is None:
            ag += shard * 4  # forward, plain
        else:
            qag += quantized_nbytes(shard, g_bits, effective_group_size(min(GROUP, shard), shard))
        ag += shard * 4  # backward, plain
        g = effective_group_size(min(GROUP, shard), shard)
        chunk = reduce_scatter_chunk(padded, W, g)
        qrs += quantized_nbytes(W * chunk, reduce_bits.get(padded * 4, 4), g) // W
    return {"quantized_all_gather": qag * STEPS, "all_gather": ag * STEPS, "quantized_reduce_scatter": qrs * STEPS}


@pytest.fixture
def plan_files(tmp_path):
    paths = {}
    for name, doc in (("plan", plan_doc()), ("size4", plan_doc(size=4, rpn=2)), ("rpn2", plan_doc(rpn=2)),
                      ("mpi", plan_doc(backend="mpi"))):
        paths[name] = str(tmp_path / f"{name}.json")
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    return paths


@pytest.mark.timeout(200)
def test_plan_sets_the_engine_bits_and_bytes(plan_files):
    results = run_world(_world, W, ranks_per_node=RPN, args=(plan_files,), env={TUNE_FILE_ENV: ""}, timeout=170)
    for rank, r in enumerate(results):
        plain, planned = r["plain"], r["plan"]
        units = planned["units"]
        assert units == plain["units"] and len(units) == 3
        gathers = sorted(p * 4 for _, p in units)
        # the plan's choice at each unit's size: plain below the cut, int8 above; int8 gradients
        assert planned["gather_bits"] == {n: (8 if n >= GATHER_CUT else None) for n in gathers}
        assert sum(b is None for b in planned["gather_bits"].values()) == 2
        assert planned["reduce_bits"] == {n: 8 for n in gathers}
        assert plain["gather_bits"] == {} and plain["reduce_bits"] == {}  # no plan: 8-bit weights, 4-bit grads
        for name, run, kw in (("plain", plain, {"gather_bits": {}, "reduce_bits": {}}),
                              ("plan", planned, {"gather_bits": planned["gather_bits"],
                                                 "reduce_bits": planned["reduce_bits"]})):
            want = _expected(units, **kw)
            got = {k: run["bytes"][k][1] for k in want}
            assert got == want, (rank, name, got, want)
            assert torch.isfinite(torch.tensor(run["loss"]))
        # the gradients' wire bytes grow as int8 over int4 predicts (codes twice as wide,
        # the same scales), and the small gathers move to the plain all-gather
        want_plan, want_plain = (_expected(units, **kw) for kw in (
            {"gather_bits": planned["gather_bits"], "reduce_bits": planned["reduce_bits"]},
            {"gather_bits": {}, "reduce_bits": {}}))
        ratio = planned["bytes"]["quantized_reduce_scatter"][1] / plain["bytes"]["quantized_reduce_scatter"][1]
        assert ratio == want_plan["quantized_reduce_scatter"] / want_plain["quantized_reduce_scatter"]
        assert 1.5 < ratio < 2.0  # 8-bit codes, unchanged fp32 scales per group of 256
        assert planned["bytes"]["quantized_all_gather"][1] < plain["bytes"]["quantized_all_gather"][1]
        assert planned["bytes"]["all_gather"][1] > plain["bytes"]["all_gather"][1]
        # rank 0 says which bits it took from the plan and why; the others are quiet
        log = "\n".join(planned["log"])
        if rank == 0:
            assert "qgZ gradient reduce-scatters follow the tune plan" in log and "8 bits for 3 units" in log
            assert "its fastest reduce_scatter on torch within max_error 0.01; it excluded int4 (maxrelerr > " \
                   "0.01, worst maxrelerr 0.031)" in log
            assert "zpp.gradient_bits is unset (without a plan: 4)" in log
            assert "qwZ weight gathers follow the tune plan" in log and "plain for 2 units" in log
        else:
            assert "tune plan" not in log
        # a configured width that contradicts the plan: the same ValueError on every rank
        assert r["conflict"].startswith("ValueError: zpp.initialize: zpp.gradient_bits=4 contradicts the tune plan")
        assert "int8 (8 bits) for reduce_scatter" in r["conflict"] and plan_files["plan"] in r["conflict"]
        assert r["agrees"] == "no error"
        assert "made for a world of 4 ranks (2 nodes x 2)" in r["other_size"] and "has 2 ranks" in r["other_size"]
        assert "made for a world of 2 ranks (1 nodes x 2)" in r["other_rpn"]
        assert "(2 nodes x 1)" in r["other_rpn"]
        # the transport passed in (torch) overrides the plan's mpi: warned on rank 0 only
        assert "overrides the plan" in r["chosen_by"] and "which chose mpi" in r["chosen_by"]
        assert len(r["override_warnings"]) == (1 if rank == 0 else 0)
        if rank == 0:
            assert "'torch' from the transport passed to zpp.initialize" in r["override_warnings"][0]
            assert "the job runs on 'torch'" in r["override_warnings"][0]
        assert set(r["mpi_plan_bits"].values()) == {8}
    assert results[0]["conflict"] == results[1]["conflict"]


# ---------------------------------------------------------------------------- one process
def test_plan_bits_pure():
    plan = TunePlan.from_dict(plan_doc(), source="p.json")
    assert plan_bits(plan, "all_gather", [1024, GATHER_CUT, 1 << 20], backend="torch", key="weight_bits",
                     explicit=None) == {1024: None, GATHER_CUT: 8, 1 << 20: 8}
    assert plan_bits(plan, "all_gather", [1024], backend="torch", key="weight_bits", explicit=4) == {1024: None}
    with pytest.raises(ValueError, match=r"zpp.weight_bits=4 contradicts the tune plan p.json: it chooses int8 "
                                         r"\(8 bits\) for all_gather of 32768 bytes \(and 1 more sizes\)"):
        plan_bits(plan, "all_gather", [GATHER_CUT, 1 << 20], backend="torch", key="weight_bits", explicit=4)
    doc = plan_doc()
    doc["entries"] = doc["by_backend"]["torch"] = [e for e in doc["entries"] if e["op"] != "reduce_scatter"]
    with pytest.raises(KeyError):
        plan_bits(TunePlan.from_dict(doc), "reduce_scatter", [1024], backend="torch", key="gradient_bits",
                  explicit=None)


def test_config_bits_default_to_the_plan():
    cfg = from_deepspeed({"zpp": {"tune_plan": "plan.json"}})
    assert (cfg.zpp.tune_plan, cfg.zpp.weight_bits, cfg.zpp.gradient_bits) == ("plan.json", None, None)
    with pytest.raises(ValueError, match=r"zpp.tune_plan.*3"):
        from_deepspeed({"zpp": {"tune_plan": 3}})


class _Fake:
    def __init__(self, name, rank=0):
        self.name, self.rank = name, rank


@pytest.fixture
def fake_backends(monkeypatch):
    for name in ("torch", "mpi"):
        monkeypatch.setitem(registry._REGISTRY, name, lambda _n=name, **kw: _Fake(_n))
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    monkeypatch.delenv(TUNE_FILE_ENV, raising=False)
    monkeypatch.setattr(registry, "_WARNED", set())


def test_get_transport_override_warns_and_records(fake_backends, monkeypatch, tmp_path):
    path = tmp_path / "mpi.json"
    path.write_text(json.dumps(plan_doc(backend="mpi")))
    monkeypatch.setenv(TUNE_FILE_ENV, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # following the plan: no warning
        world = registry.get_transport()
    assert world.name == "mpi" and world.chosen_by == str(path)
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    with pytest.warns(UserWarning, match=r"'torch' from \$ZPP_COMM_BACKEND overrides the tune plan .*mpi.json, "
                                         r"which chose 'mpi'; the job runs on 'torch'"):
        world = registry.get_transport()
    assert world.name == "torch"
    assert world.chosen_by == f"$ZPP_COMM_BACKEND (overrides the plan {path}, which chose mpi)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        registry.get_transport()
    monkeypatch.delenv(registry.BACKEND_ENV)
    with pytest.warns(UserWarning, match=r"'torch' from the argument .* overrides the tune plan"):
        world = registry.get_transport("torch")
    assert "overrides the plan" in world.chosen_by
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.get_transport("mpi").chosen_by.startswith("the argument")  # agrees: quiet
        assert registry.get_transport("torch", plan=None).chosen_by.startswith("the argument")  # no plan


def test_get_transport_warns_on_rank_0_only(fake_backends, monkeypatch, tmp_path):
    monkeypatch.setitem(registry._REGISTRY, "torch", lambda **kw: _Fake("torch", rank=1))
    plan = TunePlan.from_dict(plan_doc(backend="mpi"), source="mpi.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        world = registry.get_transport("torch", plan=plan)
    assert world.chosen_by.endswith("(overrides the plan mpi.json, which chose mpi)")
    with pytest.raises(TypeError, match="plan must be a TunePlan, a path or None, not int"):
        registry.get_transport(plan=3)


def test_cluster_run_exports_the_backend_only_when_asked(tmp_path):
    assert launch_backend(None, {}) == ("torch", {}, None)
    assert launch_backend("mpi", {}) == ("mpi", {"ZPP_COMM_BACKEND": "mpi"}, None)
    path = tmp_path / "mpi.json"
    path.write_text(json.dumps(plan_doc(backend="mpi")))
    env = {TUNE_FILE_ENV: str(path)}
    backend, exported, note = launch_backend(None, env)
    assert (backend, exported) == ("mpi", {}) and "the backend of the tune plan" in note
    backend, exported, note = launch_backend("torch", env)
    assert (backend, exported) == ("torch", {"ZPP_COMM_BACKEND": "torch"})
    assert "--backend torch sets ZPP_COMM_BACKEND=torch, which overrides the tune plan" in note
    assert launch_backend("mpi", env)[2] is None  # agrees with the plan
    with pytest.raises(ValueError, match="invalid backend 'nccl'"):
        launch_backend("nccl", env)


def test_cluster_run_help_names_the_variable():
    import argparse

    from zpp.cluster import cli

    parser = argparse.ArgumentParser(prog="zpp cluster")
    cli.add_arguments(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["run"].format_help()
    assert "ZPP_COMM_BACKEND" in text and "ZPP_TUNE_FILE" in text
