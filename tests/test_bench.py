"""``zpp bench`` end to end: the command as a user runs it, its table, JSON and errors.

Each run is a subprocess with a hard timeout (the command spawns its own ranks); runs are
few and small because starting ranks costs seconds on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import needs_mpi
from zpp.bench.config import OPS, BenchConfig, applicable, format_size, parse_size, parse_sizes
from zpp.bench.harness import Row, count_for, iterations
from zpp.bench.launch import detect
from zpp.bench.report import COLUMNS, loopback_note

ROOT = Path(__file__).resolve().parent.parent
_LAUNCHER_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                            r"TORCHELASTIC_.*|PMI_.*|OMPI_.*|MPI_LOCAL.*|ZPP_RANKS_PER_NODE|"
                            r"ZPP_COMM_BACKEND|ZPP_BENCH_CHILD)$")


def _env() -> dict[str, str]:
    """This environment minus any launcher's variables: the command must start 'alone'."""
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _bench(*args: str, timeout: float = 150, env: dict | None = None, prefix=()) -> subprocess.CompletedProcess:
    cmd = [*prefix, sys.executable, "-m", "zpp", "bench", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _parse(stdout: str) -> tuple[list[str], dict[str, list[dict]], list[str]]:
    """(header lines, rows per op, footer lines); fails on any line that is neither."""
    header, footer, rows = [], [], {}
    op = None
    for line in stdout.splitlines():
        if line.startswith("#"):
            text = line[1:].strip()
            if text in OPS:
                op = text
                rows[op] = []
            elif op is None:
                header.append(text)
            elif text.startswith(("Avg bus bandwidth", "Out of bounds")):
                footer.append(text)
            continue
        cells = line.split()
        assert op is not None and len(cells) == len(COLUMNS), f"not a table row: {line!r}"
        size, count, dtype, variant, time_us, algbw, busbw, wrong, inter, ratio, err = cells
        rows[op].append({
            "size": int(size), "count": int(count), "dtype": dtype, "variant": variant,
            "time_us": float(time_us), "algbw": float(algbw), "busbw": float(busbw),
            "wrong": int(wrong), "inter": int(inter), "ratio": float(ratio), "maxrelerr": float(err),
        })
    return header, rows, footer


def _check_table(stdout: str, world: int, nodes: int) -> dict[str, list[dict]]:
    header, rows, footer = _parse(stdout)
    assert any(f"world {world} ranks = {nodes} nodes x {world // nodes} ranks per node" in h for h in header)
    assert any(re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", h) for h in header), header  # the date
    assert any("backend" in h and "dtype float32" in h for h in header)
    # on one node, the header says what ratio compares and how to emulate nodes
    assert any(h.startswith("one node: nothing crosses a node") and "ZPP_RANKS_PER_NODE" in h
               for h in header) == (nodes == 1), header
    assert any("size(B)" in line and "maxrelerr" in line for line in stdout.splitlines() if line.startswith("#"))
    variants = [(op, r["variant"]) for op in rows for r in rows[op]]
    for op in rows:
        for r in rows[op]:
            assert r["wrong"] == 0, (op, r)
            assert r["dtype"] == "float32" and r["count"] * 4 == r["size"]
            assert r["time_us"] > 0 and r["algbw"] >= 0
            # busbw = algbw * factor, up to the printed 3 decimals
            assert abs(r["busbw"] - r["algbw"] * _factor(op, world)) <= 1.5e-3, (op, r)
            if r["variant"] == "none":
                assert r["ratio"] == 1.0 and r["maxrelerr"] < 1e-6, (op, r)
            if nodes == 1:
                assert r["inter"] == 0
    # nccl-tests footers: one average per variant, then the out-of-bounds total
    avgs = [f for f in footer if f.startswith("Avg bus bandwidth")]
    assert len(avgs) == len(set(variants))
    assert footer[-1] == "Out of bounds values : 0 OK"
    return rows


def _ratio(rows: list[dict], variant: str, min_size: int) -> list[float]:
    found = [r["ratio"] for r in rows if r["variant"] == variant and r["size"] >= min_size]
    assert found, (variant, min_size)
    return found


@pytest.mark.timeout(240)
def test_bench_two_ranks_table_json_and_plot(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--sizes", "1K:64K", "--iters", "3", "--warmup", "1", "--nprocs", "2", "--json", str(out)]
    plot = tmp_path / "bench.png"  # matplotlib: the plot extra, which the test extra includes
    args += ["--plot", str(plot)]
    res = _bench(*args)
    assert res.returncode == 0, res.stderr
    rows = _check_table(res.stdout, world=2, nodes=1)
    assert list(rows) == list(OPS)
    assert [r["variant"] for r in rows["all_gather"][:3]] == ["none", "int8", "int4"]
    assert [r["variant"] for r in rows["reduce_scatter"][:4]] == ["none", "2hop", "int8", "int4"]
    assert {r["size"] for r in rows["all_to_all"]} == {1 << k for k in range(10, 17)}
    # compression on the wire, measured by the counters
    assert all(3.9 < x <= 4.0 for x in _ratio(rows["all_gather"], "int8", 64 << 10))
    assert all(7.8 < x <= 8.0 for x in _ratio(rows["all_gather"], "int4", 64 << 10))
    assert all(3.9 < x <= 4.0 for x in _ratio(rows["reduce_scatter"], "int8", 64 << 10))
    assert all(7.8 < x <= 8.0 for x in _ratio(rows["reduce_scatter"], "int4", 64 << 10))
    assert all(30 < x <= 32 for x in _ratio(rows["all_reduce"], "1bit", 16 << 10))
    assert [r["variant"] for r in rows["all_reduce"][:4]] == ["none", "int8", "int4", "1bit"]
    assert all(3.8 < x <= 4.0 for x in _ratio(rows["all_reduce"], "int8", 64 << 10))
    assert all(7.5 < x <= 8.0 for x in _ratio(rows["all_reduce"], "int4", 64 << 10))
    # quantization error: nonzero and of the expected order
    assert all(0 < r["maxrelerr"] < 0.01 for r in rows["all_gather"] if r["variant"] == "int8")
    assert all(0 < r["maxrelerr"] < 0.2 for r in rows["all_gather"] if r["variant"] == "int4")

    doc = json.loads(out.read_text())
    meta, jrows = doc["meta"], doc["rows"]
    assert meta["world_size"] == 2 and meta["nodes"] == 1 and meta["backend"] == "torch"
    assert meta["dtype"] == "float32" and meta["date"] and doc["columns"] == list(COLUMNS)
    assert len(jrows) == sum(len(v) for v in rows.values())
    for j in jrows:
        assert j["wrong"] == 0
        assert j["busbw"] == pytest.approx(j["algbw"] * _factor(j["op"], 2), rel=1e-12)
        assert j["algbw"] == pytest.approx(j["size"] / (j["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert j["wire_bytes"] == j["intra_bytes"] + j["inter_bytes"]
        assert j["ratio"] == pytest.approx(j["size"] * _factor(j["op"], 2) / j["wire_bytes"], rel=1e-12)
    table_rows = [(op, r["size"], r["variant"], r["wrong"]) for op in rows for r in rows[op]]
    assert table_rows == [(j["op"], j["size"], j["compress"], j["wrong"]) for j in jrows]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
def test_bench_two_emulated_nodes():
    res = _bench("--sizes", "16K:64K:4", "--iters", "2", "--warmup", "1", "--nprocs", "4",
                 "--ranks-per-node", "2")
    assert res.returncode == 0, res.stderr
    rows = _check_table(res.stdout, world=4, nodes=2)
    for op in OPS:
        plain = {r["size"]: r["inter"] for r in rows[op] if r["variant"] == "none"}
        assert all(v > 0 for v in plain.values()), op
        for r in rows[op]:
            # compression cuts the inter-node bytes (below 16K, padding to whole groups wins)
            if r["variant"] != "none" and r["size"] >= 16 << 10:
                assert 0 < r["inter"] < plain[r["size"]], (op, r)
    assert all(7.8 < x <= 8.0 for x in _ratio(rows["reduce_scatter"], "int4", 64 << 10))
    assert all(3.9 < x <= 4.0 for x in _ratio(rows["all_gather"], "int8", 64 << 10))
    # 2hop: qgZ's two hops uncompressed send 1/R of the flat reduce-scatter across nodes
    plain = {r["size"]: r["inter"] for r in rows["reduce_scatter"] if r["variant"] == "none"}
    two_hop = {r["size"]: r["inter"] for r in rows["reduce_scatter"] if r["variant"] == "2hop"}
    assert sorted(two_hop) == sorted(plain) and all(2 * two_hop[s] == plain[s] for s in plain), (two_hop, plain)


@needs_mpi[0]
@needs_mpi[1]
@pytest.mark.timeout(240)
def test_bench_under_mpiexec():
    res = _bench("--sizes", "1K:16K:4", "--iters", "2", "--warmup", "1", "--op", "all_gather,all_reduce",
                 prefix=("mpiexec", "-n", "2"))
    assert res.returncode == 0, res.stderr
    rows = _check_table(res.stdout, world=2, nodes=1)
    assert list(rows) == ["all_gather", "all_reduce"]
    assert "backend mpi" in res.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, names", [
    (["--op", "all_scatter"], ["--op", "'all_scatter'"]),
    (["--sizes", "4M:1K"], ["--sizes", "'4M:1K'"]),
    (["--sizes", "abc"], ["--sizes", "'abc'"]),
    (["--compress", "int3"], ["--compress", "'int3'"]),
    (["--nprocs", "3", "--ranks-per-node", "2"], ["--nprocs 3", "--ranks-per-node 2"]),
    (["-n", "3", "--ranks-per-node", "2"], ["--nprocs 3", "--ranks-per-node 2"]),  # mpirun's -n
    (["--compress", "int4", "--op", "all_to_all"], ["nothing to run", "all_to_all/int4"]),
    (["--iters", "0"], ["--iters", "'0'"]),
])
def test_bad_arguments_exit_2_naming_the_value(args, names):
    res = _bench(*args, timeout=50)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stdout == ""
    for name in names:
        assert name in res.stderr, (name, res.stderr)


@pytest.mark.timeout(60)
def test_rank_failure_is_reported():
    res = _bench("--sizes", "1K", "--iters", "1", "--nprocs", "2", env={"ZPP_QUANT_IMPL": "bogus"})
    assert res.returncode == 1
    assert "rank 0 failed" in res.stderr and "ZPP_QUANT_IMPL='bogus'" in res.stderr
    assert "Out of bounds" not in res.stdout


@pytest.mark.timeout(60)
def test_hard_timeout_stops_the_ranks():
    res = _bench("--nprocs", "2", "--timeout", "0.5")
    assert res.returncode == 124
    assert "timed out after 0.5 s" in res.stderr


def test_sizes_syntax():
    assert parse_size("4096") == 4096 and parse_size("64K") == 65536 and parse_size("2MiB") == 2 << 20
    assert parse_sizes("1K:8K") == (1024, 2048, 4096, 8192)
    assert parse_sizes("1K:64K:4") == (1024, 4096, 16384, 65536)
    assert parse_sizes("1K,1M") == (1024, 1 << 20) and parse_sizes("3K") == (3072,)
    assert parse_sizes("1K:3K") == (1024, 2048)
    assert format_size(1 << 20) == "1M" and format_size(1536) == "1536"
    for bad in ("0", "4M:1K", "abc", "1K:2K:1", "1K:2K:3:4", "1K,1K", "-1K"):
        with pytest.raises(ValueError) as info:
            parse_sizes(bad)
        assert repr(bad) in str(info.value)


def test_config_and_selection():
    chosen, skipped = applicable(("all_gather", "all_reduce"), ("int8", "1bit"))
    assert chosen == [("all_gather", "int8"), ("all_reduce", "int8"), ("all_reduce", "1bit")]
    assert skipped == ["all_gather/1bit"]
    with pytest.raises(ValueError, match="group_size=3"):
        BenchConfig(group_size=3)
    with pytest.raises(ValueError, match="'gather'"):
        BenchConfig(ops=("gather",))


def test_iterations_shrink_for_large_sizes():
    assert iterations(1 << 20, 5, 20) == (5, 20)
    assert iterations(4 << 20, 5, 20) == (2, 5)
    assert iterations(64 << 20, 5, 20) == (1, 1)
    assert iterations(64 << 20, 0, 20) == (0, 1)
    assert count_for(1024, 4, 4) == 256 and count_for(1024, 3, 4) == 255 and count_for(2, 4, 4) == 4


def test_launcher_detection():
    assert detect({}).kind == "alone"
    hydra = detect({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (hydra.kind, hydra.rank, hydra.world_size, hydra.local_size) == ("mpi", 1, 4, 2)
    ompi = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"})
    assert (ompi.kind, ompi.rank, ompi.world_size) == ("mpi", 3, 8)
    run = detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (run.kind, run.world_size, run.local_size) == ("torchrun", 2, 2)
    both = detect({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "PMI_RANK": "0", "PMI_SIZE": "1"})
    assert both.kind == "torchrun"
    with pytest.raises(ValueError, match="PMI_SIZE='four'"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "four"})


def _row(op: str, compress: str, time_us: float, size: int = 1 << 20) -> Row:
    return Row(op=op, compress=compress, size=size, count=size // 4, dtype="float32", time_us=time_us, algbw=0.0,
               busbw=0.0, wrong=0, inter_bytes=0, intra_bytes=0, wire_bytes=0, ratio=None, logical_per_wire=None,
               maxrelerr=0.0, max_abs_err=0.0, warmup=1, iters=1)


def test_loopback_note_says_why_compression_lost():
    rows = [_row("all_reduce", "none", 100.0), _row("all_reduce", "int8", 260.0), _row("all_reduce", "int4", 90.0),
            _row("reduce_scatter", "none", 100.0), _row("reduce_scatter", "2hop", 150.0)]
    note = loopback_note(rows, on_cluster=False)
    assert note.startswith("note: all_reduce/int8 slower than plain here") and "zpp cluster run" in note, note
    assert loopback_note(rows, on_cluster=True) is None  # under zpp cluster run the table answers
    assert loopback_note(rows[:1] + rows[2:], on_cluster=False) is None  # int4 won, 2hop is not compression
