"""``zpp tune``: the planner on synthetic bench rows, plan files, the plan's consumers
(get_transport, zpp.comm.tuned in a 2-rank world) and the command end to end.

Multi-process tests are few (one world, one or two commands) and carry hard timeouts: on
2 cores each start of ranks costs seconds.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import needs_mpi, run_world
from zpp.comm import registry
from zpp.comm.plan import TUNE_FILE_ENV, Choice, TunePlan, load_plan
from zpp.tune.planner import TABLE_COLUMNS, boundaries, build_plan, format_bytes, format_table, table_rows

ROOT = Path(__file__).resolve().parent.parent
K = 1 << 10
_LAUNCHER_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                            r"TORCHELASTIC_.*|PMI_.*|OMPI_.*|MPI_LOCAL.*|ZPP_RANKS_PER_NODE|"
                            r"ZPP_COMM_BACKEND|ZPP_BENCH_CHILD|ZPP_TUNE_FILE)$")


def row(backend, op, compress, size, time_us, err=0.0, wrong=0):
    return {"backend": backend, "op": op, "compress": compress, "size": size, "time_us": time_us,
            "maxrelerr": err, "wrong": wrong}


def plan_of(rows, **kw):
    kw = {"world_size": 2, "ranks_per_node": 1, "max_error": 0.01, **kw}
    return build_plan(rows, **kw)


def entries(plan, op=None):
    return [(e.op, e.min_bytes, e.max_bytes, e.backend, e.compress) for e in plan.entries
            if op is None or e.op == op]


# ---------------------------------------------------------------------------- planner
def test_fastest_within_the_error_bound_wins():
    rows = [row("torch", "all_gather", "none", 64 * K, 100.0),
            row("torch", "all_gather", "int8", 64 * K, 60.0, err=0.004),
            row("torch", "all_gather", "int4", 64 * K, 40.0, err=0.07),
            row("mpi", "all_gather", "none", 64 * K, 80.0),
            row("mpi", "all_gather", "int8", 64 * K, 55.0, err=0.004)]
    plan = plan_of(rows)
    assert entries(plan) == [("all_gather", 0, None, "mpi", "int8")]
    assert plan.choose("all_gather", 1) == Choice("mpi", "int8")
    # the int4 row was left out for its error, and the plan says so
    (x,) = [x for x in plan.meta["excluded"] if x["compress"] == "int4"]
    assert x["reason"].startswith("maxrelerr > 0.01") and x["maxrelerr"] == 0.07
    # a looser bound admits it
    assert plan_of(rows, max_error=0.1).choose("all_gather", 64 * K) == Choice("torch", "int4")
    # the per-backend lists hold each backend's own best
    assert plan.choose("all_gather", 64 * K, backend="torch") == Choice("torch", "int8")
    assert plan.choose("all_gather", 64 * K, backend="nccl") == Choice("mpi", "int8")  # not measured
    # vs plain: against the first backend's plain time at that size
    (m,) = plan.entries[0].measured
    assert m == {"size": 64 * K, "time_us": 55.0, "plain_us": 100.0, "maxrelerr": 0.004}


def test_plain_is_always_eligible_and_wrong_rows_never():
    rows = [row("torch", "reduce_scatter", "none", 4 * K, 50.0, err=2e-7),
            row("torch", "reduce_scatter", "int8", 4 * K, 10.0, err=0.001, wrong=3),
            row("torch", "reduce_scatter", "int4", 4 * K, 20.0, err=None)]
    plan = plan_of(rows, max_error=0.0)
    assert entries(plan) == [("reduce_scatter", 0, None, "torch", "none")]
    reasons = {x["compress"]: x["reason"] for x in plan.meta["excluded"]}
    assert reasons == {"int8": "3 values outside its own error bound", "int4": "no finite maxrelerr"}


def test_ties_prefer_less_compression_then_the_first_backend():
    rows = [row("mpi", "all_gather", "int8", 4 * K, 10.0, err=0.001),
            row("mpi", "all_gather", "none", 4 * K, 10.0),
            row("torch", "all_gather", "none", 4 * K, 10.0)]
    assert entries(plan_of(rows, backends=["torch", "mpi"])) == [("all_gather", 0, None, "torch", "none")]
    assert entries(plan_of(rows, backends=["mpi", "torch"])) == [("all_gather", 0, None, "mpi", "none")]


def test_buckets_split_at_geometric_midpoints_and_merge():
    assert boundaries([131072, 65536]) == [(0, 92681), (92681, None)]
    assert boundaries([100]) == [(0, None)]
    assert boundaries([4, 5]) == [(0, 5), (5, None)]  # the midpoint is above the lower size
    sizes = [64 * K, 128 * K, 256 * K, 512 * K, 1024 * K]
    choice = ["int8", "int8", "none", "none", "int8"]
    rows = []
    for s, c in zip(sizes, choice):
        rows.append(row("torch", "all_gather", "none", s, 100.0))
        rows.append(row("torch", "all_gather", "int8", s, 50.0 if c == "int8" else 150.0, err=0.004))
    plan = plan_of(rows)
    cut1, cut2 = math.isqrt(128 * K * 256 * K), math.isqrt(512 * K * 1024 * K)
    assert entries(plan) == [("all_gather", 0, cut1, "torch", "int8"),
                             ("all_gather", cut1, cut2, "torch", "none"),
                             ("all_gather", cut2, None, "torch", "int8")]
    assert [len(e.measured) for e in plan.entries] == [2, 2, 1]
    # below the smallest and above the largest measured size the nearest choice extends
    assert plan.choose("all_gather", 0).compress == "int8"
    assert plan.choose("all_gather", cut1 - 1).compress == "int8"
    assert plan.choose("all_gather", cut1).compress == "none"
    assert plan.choose("all_gather", 1 << 40).compress == "int8"
    with pytest.raises(KeyError, match="all_reduce"):
        plan.choose("all_reduce", 1)
    with pytest.raises(ValueError, match="-1"):
        plan.choose("all_gather", -1)


def test_1bit_only_when_allowed_whatever_its_one_call_error():
    rows = [row("torch", "all_reduce", "none", 1 << 20, 900.0),
            row("torch", "all_reduce", "1bit", 1 << 20, 100.0, err=0.8)]
    assert entries(plan_of(rows)) == [("all_reduce", 0, None, "torch", "none")]
    assert "--allow-1bit" in plan_of(rows).meta["excluded"][0]["reason"]
    plan = plan_of(rows, allow_1bit=True)
    assert entries(plan) == [("all_reduce", 0, None, "torch", "1bit")]
    assert plan.allow_1bit and "1bit allowed" in format_table(plan)


def test_backend_wins_most_buckets_and_the_table():
    rows = []
    for s in (4 * K, 16 * K, 64 * K):
        rows += [row("torch", "all_gather", "none", s, 10.0), row("mpi", "all_gather", "none", s, 20.0)]
        rows += [row("torch", "all_reduce", "none", s, 30.0), row("mpi", "all_reduce", "none", s, 5.0)]
    rows += [row("torch", "reduce_scatter", "none", 4 * K, 30.0), row("mpi", "reduce_scatter", "none", 4 * K, 5.0)]
    plan = plan_of(rows)
    # torch wins one merged entry of 3 buckets, mpi two entries of 3 + 1
    assert [(e.backend, e.weight) for e in plan.entries] == [("torch", 3), ("mpi", 1), ("mpi", 3)]
    assert plan.backend() == "mpi"
    tie = plan_of([row("mpi", "all_gather", "none", 4 * K, 5.0), row("torch", "all_reduce", "none", 4 * K, 5.0)],
                  backends=["torch", "mpi"])
    assert tie.backend() == "torch"
    text = format_table(plan)
    body = [line.split() for line in text.splitlines() if not line.startswith("#")]
    assert body == [list(cells) for cells in table_rows(plan)]
    assert all(len(cells) == len(TABLE_COLUMNS) for cells in body)
    assert body[0][:4] == ["all_gather", "0-inf", "torch", "none"] and body[0][5] == "1.00x"
    assert body[2][:5] == ["all_reduce", "0-inf", "mpi", "none", "5.0"] and body[2][5] == "0.17x"
    assert "# backend: mpi (wins 4 of 7 measured sizes)" in text
    assert [format_bytes(n) for n in (0, 1000, 1024, 92681, 16 << 20, None)] == ["0", "1000", "1K", "90.5K", "16M", "inf"]


# ---------------------------------------------------------------------------- plan files
def _sample_plan() -> TunePlan:
    rows = []
    for s in (4 * K, 64 * K):
        rows += [row("torch", "all_gather", "none", s, 10.0), row("torch", "all_gather", "int8", s, s / 8192, err=0.004),
                 row("mpi", "all_gather", "none", s, 3.0)]
    rows.append(row("mpi", "all_gather", "int8", 4 * K, 0.2, err=0.004))  # mpi: int8, then none
    return plan_of(rows, world_size=4, ranks_per_node=2, meta={"host": "here"})


def test_plan_save_load_round_trip(tmp_path, monkeypatch):
    plan = _sample_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    back = TunePlan.load(path)
    assert back == plan and back.path == str(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["world"] == {"size": 4, "ranks_per_node": 2}
    assert doc["max_error"] == 0.01 and doc["meta"]["host"] == "here"
    monkeypatch.delenv(TUNE_FILE_ENV, raising=False)
    assert load_plan() is None
    monkeypatch.setenv(TUNE_FILE_ENV, str(path))
    assert load_plan() == plan and load_plan() is load_plan()  # cached until the file changes
    monkeypatch.setenv(TUNE_FILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match=f"missing.json.*{TUNE_FILE_ENV}"):
        load_plan()


def _good() -> dict:
    return _sample_plan().to_dict()


def _set(path, value):
    def edit(doc):
        *keys, last = path
        for k in keys:
            doc = doc[k]
        if value is _DELETE:
            del doc[last]
        else:
            doc[last] = value
    return edit


_DELETE = object()


@pytest.mark.parametrize("edit, problem", [
    (_set(["version"], 2), "version 2 is not supported"),
    (_set(["version"], _DELETE), "version None"),
    (_set(["world"], [4, 2]), "'world' must be an object"),
    (_set(["world", "size"], 0), "world.size 0"),
    (_set(["world", "ranks_per_node"], 3), "ranks_per_node 3 must be a positive integer dividing world.size 4"),
    (_set(["max_error"], -0.1), "max_error -0.1"),
    (_set(["entries"], []), "entries is empty"),
    (_set(["entries", 0, "op"], "all_to_all"), "entries[0]: op 'all_to_all'"),
    (_set(["entries", 0, "compress"], "1bit"), "entries[0]: compress '1bit' is not one of all_gather's"),
    (_set(["entries", 0, "min_bytes"], 5), "all_gather starts at 5 bytes, not 0"),
    (_set(["entries", 0, "max_bytes"], 100), "leave a gap"),
    (_set(["entries", 0, "max_bytes"], 1 << 30), "overlap"),
    (_set(["entries", -1, "max_bytes"], 1 << 30), "last range ends at 1073741824 bytes"),
    (_set(["entries", 0, "backend"], ""), "entries[0]: backend ''"),
    (_set(["by_backend", "torch", 0, "backend"], "mpi"), "by_backend.torch: an entry names backend 'mpi'"),
])
def test_malformed_plan_names_the_file_and_the_problem(tmp_path, edit, problem):
    doc = _good()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        TunePlan.load(path)
    assert str(info.value).startswith(f"{path}: ") and problem in str(info.value), str(info.value)


def test_plan_that_is_not_json_or_not_an_object(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: not a zpp tune plan: invalid JSON"):
        load_plan(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"bad.json: a plan is a JSON object, not list"):
        load_plan(path)
    doc = _good()
    doc["entries"][-1]["compress"] = "1bit"
    doc["entries"][-1]["op"] = "all_reduce"
    doc["entries"][-1]["min_bytes"] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="chooses 1bit but the plan has allow_1bit false"):
        load_plan(path)


# ---------------------------------------------------------------------------- get_transport
def test_get_transport_takes_the_plan_backend(tmp_path, monkeypatch):
    made = []
    for name in ("torch", "mpi"):
        monkeypatch.setitem(registry._REGISTRY, name, lambda _n=name, **kw: made.append((_n, kw)) or _n)
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    monkeypatch.delenv(TUNE_FILE_ENV, raising=False)
    assert registry.get_transport() == "torch"  # no plan: the default
    plan = _sample_plan()  # mpi wins both buckets
    assert plan.backend() == "mpi"
    path = tmp_path / "plan.json"
    plan.save(path)
    monkeypatch.setenv(TUNE_FILE_ENV, str(path))
    assert registry.get_transport(timeout_s=5) == "mpi" and made[-1] == ("mpi", {"timeout_s": 5})
    monkeypatch.setattr(registry, "_WARNED", set())
    with pytest.warns(UserWarning, match="from the argument .* overrides the tune plan"):
        assert registry.get_transport("torch") == "torch"  # an explicit name wins, loudly
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    with pytest.warns(UserWarning, match=r"from \$ZPP_COMM_BACKEND overrides the tune plan"):
        assert registry.get_transport() == "torch"  # and so does $ZPP_COMM_BACKEND
    monkeypatch.delenv(registry.BACKEND_ENV)
    doc = plan.to_dict()
    for e in doc["entries"]:
        e["backend"] = "carrier-pigeon"
    del doc["by_backend"]["mpi"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"unknown transport 'carrier-pigeon' \(from .*plan.json\)"):
        registry.get_transport()


# ---------------------------------------------------------------------------- tuned, 2 ranks
def _world_plan(world_size: int) -> TunePlan:
    """all_gather: <8K none, <64K int8, else int4 (overall: mpi int4; torch's own: int4 too
    except 64K+ where torch measured int8 fastest); reduce_scatter: <16K int4, else none;
    all_reduce: <8K none, <16K int8, else 1bit."""
    def e(op, lo, hi, backend, compress):
        return {"op": op, "min_bytes": lo, "max_bytes": hi, "backend": backend, "compress": compress}

    return TunePlan.from_dict({
        "version": 1, "world": {"size": world_size, "ranks_per_node": 1}, "max_error": 0.1,
        "allow_1bit": True, "group_size": 512, "backends": ["mpi", "torch"],
        "entries": [e("all_gather", 0, 8 * K, "mpi", "none"), e("all_gather", 8 * K, 64 * K, "mpi", "int8"),
                    e("all_gather", 64 * K, None, "mpi", "int4"),
                    e("reduce_scatter", 0, 16 * K, "mpi", "int4"), e("reduce_scatter", 16 * K, None, "mpi", "none"),
                    e("all_reduce", 0, 8 * K, "mpi", "none"), e("all_reduce", 8 * K, 16 * K, "mpi", "int8"),
                    e("all_reduce", 16 * K, None, "mpi", "1bit")],
        "by_backend": {"torch": [e("all_gather", 0, 8 * K, "torch", "none"),
                                 e("all_gather", 8 * K, 64 * K, "torch", "int8"),
                                 e("all_gather", 64 * K, None, "torch", "int8")]},
    })


def tuned_world(transport):
    """Each tuned call against the collective it must equal, bit for bit."""
    import torch

    from zpp.comm import tuned
    from zpp.comm.collectives import quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
    from zpp.comm.onebit import OneBitAllReduce
    from zpp.comm.topology import topology_of

    plan = _world_plan(transport.world_size)
    topo = topology_of(transport)
    W, r = transport.world_size, transport.rank
    g = torch.Generator().manual_seed(1234 + r)
    out = {}
    tuned.reset_choices()
    os.environ.pop(TUNE_FILE_ENV, None)

    def same(a, b):
        return bool(torch.equal(a, b))

    # all_gather: out bytes 4K none, 16K int8, 128K int8 (torch's own list; overall says int4)
    for nbytes, bits in ((4 * K, 0), (16 * K, 8), (128 * K, 8)):
        shard = torch.randn(nbytes // 4 // W, generator=g)
        got, want = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
        tuned.all_gather(got, shard, transport=transport, plan=plan)
        if bits:
            quantized_all_gather(want, shard, transport=transport, bits=bits, group_size=512)
        else:
            transport.all_gather(want, shard)
        out[f"all_gather {nbytes}"] = same(got, want)
    # reduce_scatter: inp bytes 8K int4 (qgZ), 32K none, and an odd size on the plain path
    for nbytes, bits in ((8 * K, 4), (32 * K, 0)):
        inp = torch.randn(nbytes // 4, generator=g)
        got, want = torch.empty(nbytes // 4 // W), torch.empty(nbytes // 4 // W)
        tuned.reduce_scatter(got, inp, topology=topo, plan=plan)
        if bits:
            quantized_reduce_scatter(want, inp, topology=topo, bits=bits, group_size=512)
        else:
            transport.reduce_scatter(want, inp, op="mean")
        out[f"reduce_scatter {nbytes}"] = same(got, want)
    n = 8 * K + 3  # 32K + 12 bytes: plain, zero-padded to whole rank slices
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(99 + j)) for j in range(W)]
    s = -(-n // W)
    got = torch.empty(s)
    tuned.reduce_scatter(got, inputs[r], topology=topo, plan=plan)
    total = inputs[0].clone()
    for x in inputs[1:]:
        total += x
    exact = torch.zeros(W * s)
    exact[:n] = total / W
    out["reduce_scatter odd"] = same(got, exact[r * s:(r + 1) * s])
    # all_reduce: 4K none; 8K int8; 64K 1bit over two steps with the caller's error-feedback state
    t = torch.randn(K, generator=g)
    want = t.clone()
    transport.all_reduce(want, op="mean")
    out["all_reduce 4096"] = same(tuned.all_reduce(t, transport=transport, plan=plan), want)
    t = torch.randn(2 * K + 1, generator=g)  # 8K + 4 bytes: int8, quantized reduce-scatter + all-gather
    want = t.clone()
    quantized_all_reduce(want, topology=topo, bits=8, group_size=512)
    out["all_reduce int8"] = same(tuned.all_reduce(t, transport=transport, plan=plan), want)
    mine, ref = OneBitAllReduce(16 * K, transport), OneBitAllReduce(16 * K, transport)
    ok = True
    for _ in range(2):
        x = torch.randn(16 * K, generator=g)
        y = x.clone()
        tuned.all_reduce(x, transport=transport, plan=plan, onebit=mine)
        ref(y)
        ok &= same(x, y)
    out["all_reduce 1bit"] = ok
    try:
        tuned.all_reduce(torch.zeros(16 * K), transport=transport, plan=plan)
        out["1bit without onebit"] = "no error"
    except ValueError as e:
        out["1bit without onebit"] = str(e)
    # no plan (ZPP_TUNE_FILE unset): plain
    x = torch.ones(16 * K)
    tuned.all_reduce(x, transport=transport)
    out["no plan"] = bool((x == 1).all())
    # a plan path, through ZPP_TUNE_FILE
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"zpp-tune-test-{os.getpid()}.json")
    plan.save(path)
    os.environ[TUNE_FILE_ENV] = path
    try:
        got = torch.empty(16 * K // 4)
        tuned.all_gather(got, torch.ones(16 * K // 4 // W), transport=transport)
    finally:
        del os.environ[TUNE_FILE_ENV]
        os.remove(path)
    out["choices"] = tuned.choices()
    try:
        tuned.all_gather(torch.empty(W * 4), torch.ones(4), transport=transport, plan=_world_plan(W + 2))
        out["wrong world"] = "no error"
    except ValueError as e:
        out["wrong world"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_tuned_collectives_follow_the_plan_in_a_two_rank_world():
    results = run_world(tuned_world, 2, backend="torch", ranks_per_node=1, timeout=100)
    for rank, out in enumerate(results):
        for key, value in out.items():
            if key in ("choices", "1bit without onebit", "wrong world"):
                continue
            assert value is True, (rank, key)
        assert out["choices"] == {"all_gather/none": 1, "all_gather/int8": 3, "reduce_scatter/int4": 1,
                                  "reduce_scatter/none": 2, "all_reduce/none": 2, "all_reduce/int8": 1,
                                  "all_reduce/1bit": 2}, rank
        assert "chooses 1bit" in out["1bit without onebit"] and "onebit=OneBitAllReduce(16384" in out["1bit without onebit"]
        assert "world of 4 ranks" in out["wrong world"] and "has 2 ranks" in out["wrong world"]


# ---------------------------------------------------------------------------- the command
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _parse_table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    assert lines and all(line.startswith(("#", "  ")) for line in lines), stdout
    assert any(line.split()[1:] == list(TABLE_COLUMNS) for line in lines if line.startswith("# ")), stdout
    return [line.split() for line in lines if not line.startswith("#")]


def _check_ranges(body: list[list[str]], ops) -> None:
    for op in ops:
        ranges = [cells[1].split("-") for cells in body if cells[0] == op]
        assert ranges and ranges[0][0] == "0" and ranges[-1][1] == "inf", (op, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (op, ranges)


@pytest.mark.timeout(150)
def test_tune_command_end_to_end(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "zpp", "tune", "--nprocs", "2", "--ranks-per-node", "1", "--sizes", "4K:16K",
           "--iters", "2", "--warmup", "1", "--backends", "torch", "--out", str(out),
           "--outer-params", "1M", "--outer-step-s", "0.05", "--outer-fragments", "2"]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=140)
    assert res.returncode == 0, res.stderr
    table, sep, advice = res.stdout.partition("# zpp.outer for 1,000,000 parameters")
    assert sep, res.stdout
    body = _parse_table(table)
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    assert [cells[0] for cells in body] == sorted((c[0] for c in body), key=ops.index)
    assert {cells[0] for cells in body} == set(ops)
    assert all(cells[2] == "torch" and len(cells) == len(TABLE_COLUMNS) for cells in body)
    _check_ranges(body, ops)
    assert "world 2 ranks = 2 nodes x 1" in res.stdout and "1bit excluded" in res.stdout
    assert "# excluded: torch all_gather/int4" in res.stdout  # int4's error is above 0.01
    plan = TunePlan.load(out)
    assert (plan.world.size, plan.world.ranks_per_node, plan.max_error) == (2, 1, 0.01)
    assert [(e.op, e.compress) for e in plan.entries] == [(c[0], c[3]) for c in body]
    assert sorted(m["size"] for e in plan.entries if e.op == "all_gather" for m in e.measured) == [4 * K, 8 * K, 16 * K]
    assert all(e.compress != "int4" for e in plan.entries)
    assert plan.backend() == "torch" and f"wrote {out}" in res.stderr
    # the measured rows went to stderr, in zpp bench's format
    assert "# Out of bounds values : 0 OK" in res.stderr
    # the zpp.outer advice: one row per compression from the measured all_reduce (2 MB fragments,
    # far beyond the 16K measured: extrapolated), the chosen config, also in the plan's meta
    rows = [line.split() for line in advice.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["none", "int8", "int4"] and all(r[2].endswith("*") for r in rows), advice
    outer = plan.meta["outer"]
    assert outer["params"] == 1_000_000 and outer["fragments"] == 2 and outer["step_s"] == 0.05
    assert advice.splitlines()[-1] == '# config: "zpp": {"outer": ' + json.dumps(outer["config"]) + "}"
    from zpp.zero.outer_config import OuterConfig
    OuterConfig(**outer["config"])  # a config the engine takes


@needs_mpi[0]
@needs_mpi[1]
@pytest.mark.timeout(120)
def test_tune_inside_a_launched_world_tunes_its_backend_only(tmp_path):
    out = tmp_path / "plan.json"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "zpp", "tune", "--ops", "all_gather", "--sizes", "8K",
           "--iters", "1", "--warmup", "0", "--backends", "torch,mpi", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr
    assert "inside a mpi world of 2 ranks: tuning its backend, mpi, only (--backends torch ignored)" in res.stderr
    body = _parse_table(res.stdout)
    assert {cells[2] for cells in body} == {"mpi"} and {cells[0] for cells in body} == {"all_gather"}
    _check_ranges(body, ["all_gather"])
    assert TunePlan.load(out).backends == ("mpi",)


@pytest.mark.parametrize("args, names", [
    (["--max-error", "-1"], ["--max-error", "'-1'"]),
    (["--ops", "all_to_all"], ["--ops", "'all_to_all'"]),
    (["--backends", "nccl"], ["--backends", "'nccl'"]),
    (["--sizes", "1M:4K"], ["--sizes", "'1M:4K'"]),
    (["--outer-params", "lots", "--outer-step-s", "1"], ["--outer-params", "'lots'"]),
    (["--outer-params", "25M"], ["--outer-params", "--outer-step-s"]),
    (["--ops", "all_gather", "--outer-params", "25M", "--outer-step-s", "1"], ["--outer-params", "all_gather"]),
    (["--outer-params", "25M", "--outer-step-s", "0"], ["--outer-step-s", "'0'"]),
])
def test_bad_arguments_exit_2_naming_the_value(args, names, capsys):
    from zpp.cli import main

    with pytest.raises(SystemExit) as info:
        main(["tune", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err, (name, err)


# ---------------------------------------------------------------------------- zpp.outer advice
def test_sync_seconds_interpolates_and_extrapolates():
    from zpp.tune.outer import sync_seconds

    pts = [(1 * K, 100.0), (4 * K, 400.0), (16 * K, 1000.0)]
    assert sync_seconds(pts, 512) == (pytest.approx(100e-6), False)        # below: the smallest's time
    assert sync_seconds(pts, 2 * K) == (pytest.approx(200e-6), False)      # linear between 1K and 4K
    assert sync_seconds(pts, 16 * K) == (pytest.approx(1000e-6), False)
    # beyond: the last two sizes' time per byte (600 us per 12K) carries on
    assert sync_seconds(pts, 40 * K) == (pytest.approx((1000 + 600 * 24 / 12) * 1e-6), True)
    assert sync_seconds([(8 * K, 80.0)], 16 * K) == (pytest.approx(160e-6), True)  # one size: proportional
    assert sync_seconds([(1 * K, 90.0), (2 * K, 80.0)], 4 * K) == (pytest.approx(80e-6), True)  # no negative slope
    with pytest.raises(ValueError, match="no measured points"):
        sync_seconds([], 1)


def _link_rows(backend, mbit):
    """all_reduce rows of a link of ``mbit`` Mbit/s per node: 2 (N-1)/N = 1 times the bytes
    on the wire at 2 nodes, scaled by each compression's bytes per element, + 1 ms."""
    per_byte = {"none": 1.0, "int8": 0.25 * 1.002, "int4": 0.125 * 1.004, "1bit": 1 / 32 * 1.01}
    return [row(backend, "all_reduce", c, s, 1000.0 + s * f * 8 / mbit, err=0.01)
            for c, f in per_byte.items() for s in (1 << 20, 4 << 20)]


def test_outer_advice_picks_the_smallest_sync_every_the_link_allows():
    from zpp.tune.outer import HEADROOM, advise, format_advice

    # 25M parameters, 4 fragments: 25 MB per fragment; at 100 Mbit fp32 takes 2.0 s, int4 0.25 s
    a = advise(_link_rows("torch", 100), params=25_000_000, step_s=1.0, fragments=4)
    by = {o.compression: o for o in a.options}
    assert set(by) == {"none", "int8", "int4"}  # 1bit only when allowed
    t = by["none"].sync_s
    assert t == pytest.approx((1000 + 25_000_000 * 8 / 100) * 1e-6, rel=1e-6) and by["none"].extrapolated
    assert HEADROOM == 1.25
    assert (by["none"].delay, by["none"].sync_every) == (3, 11)           # ceil(1.25 x 2.0), ceil(1.25 x 4 x 2.0)
    assert by["none"].link_busy == pytest.approx(4 * t / 11)
    # int8 needs H = 3 and int4 H = 2 (H >= delay + 1), both raised to the mode's default H = 5
    # (shorter H lost loss): the tie goes to less compression
    assert [(o.delay, o.sync_every) for o in a.options] == [(3, 11), (1, 5), (1, 5)]
    assert a.chosen is by["int8"] and not a.link_bound
    assert a.config() == {"method": "diloco", "sync_every": 5, "fragments": 4, "delay": 1, "compression": "int8"}
    # steps long enough that every variant needs only H = delay + 1 = 2, raised to 5: the tie
    # goes to no compression
    slow_steps = advise(_link_rows("torch", 100), params=25_000_000, step_s=100.0, fragments=4)
    assert {o.sync_every for o in slow_steps.options} == {5} and slow_steps.chosen.compression == "none"
    # at 1 Mbit: fp32 H = 1001, int8 251, int4 126: above 100, so link-bound, int4 still the best
    tight = advise(_link_rows("torch", 1), params=25_000_000, step_s=1.0, fragments=4)
    assert [o.sync_every for o in tight.options] == [1001, 251, 126]
    assert tight.link_bound and tight.chosen.compression == "int4"
    assert "link-bound" in format_advice(tight) and '"compression": "int4"' in format_advice(tight)
    assert not advise(_link_rows("torch", 1), params=25_000_000, step_s=1.0, max_sync_every=150).link_bound
    with1bit = advise(_link_rows("torch", 1), params=25_000_000, step_s=1.0, fragments=4, allow_1bit=True)
    assert with1bit.chosen.compression == "1bit" and with1bit.chosen.sync_every == 32 and not with1bit.link_bound
    # the faster backend at that size is taken, per compression
    mixed = advise(_link_rows("torch", 100) + _link_rows("mpi", 200), params=25_000_000, step_s=1.0)
    assert {o.backend for o in mixed.options} == {"mpi"}
    # with the world's shape (2 nodes x 2) the row's time is scaled to what the sync puts on a
    # node's link: the world's fp32 ring all-reduce carries 2 (W-1)/W = 1.5 units per unit the
    # sync's reductions over the nodes carry (2 (N-1)/N = 1); the quantized ones 1.25
    shaped = advise(_link_rows("torch", 100), params=25_000_000, step_s=1.0, fragments=4, nodes=2, ranks_per_node=2)
    sb = {o.compression: o.sync_s for o in shaped.options}
    assert sb["none"] == pytest.approx(by["none"].sync_s / 1.5, rel=1e-6)
    assert sb["int4"] == pytest.approx(by["int4"].sync_s / 1.25, rel=1e-3)
    text = format_advice(a)
    assert text.splitlines()[-1] == '# config: "zpp": {"outer": ' + json.dumps(a.config()) + "}"
    assert "<- chosen" in text


def test_outer_advice_refuses_bad_input_naming_it():
    from zpp.tune.outer import advise

    rows = _link_rows("torch", 100)
    for kw, name in (({"params": 0}, "params=0"), ({"fragments": 1.5}, "fragments=1.5"),
                     ({"step_s": 0.0}, "step_s=0.0"), ({"max_sync_every": 1}, "max_sync_every=1")):
        args = {"params": 1000, "step_s": 1.0, **kw}
        with pytest.raises(ValueError, match=re.escape(name)):
            advise(rows, **args)
    with pytest.raises(ValueError, match="no all_reduce row"):
        advise([row("torch", "all_gather", "none", K, 1.0)], params=1000, step_s=1.0)
    wrong = [{**r, "wrong": 3} for r in rows]
    with pytest.raises(ValueError, match="no all_reduce row"):
        advise(wrong, params=1000, step_s=1.0)
