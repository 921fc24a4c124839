"""Tests for zpp.cluster: namespaces, tbf shaping, and launching ranks inside the nodes.

The tests that build a cluster are marked ``cluster``: they run only with
``ZPP_TEST_CLUSTER=1``, as root with iproute2, and when no zpp cluster is up (see
tests/conftest.py); otherwise they are skipped with a message saying so. They create only
zpp-* namespaces (198.18.0.0/24 addresses, nothing in the root namespace) and a module
finalizer removes them even when a test fails.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from zpp import cluster
from zpp.cluster import cli, launch, netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE = "20mbit"
RATE_BITS = 20_000_000
# prefixed, but not a name the cluster owns; made (and removed) only by the test that uses it
DECOY_NS = f"{netns.PREFIX}keepme-test{os.getpid()}"

needs_cluster = pytest.mark.cluster


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split(":")[1].strip().split("@")[0] for line in out.splitlines())


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "zpp.cluster", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


def _ns_inode(ns: str) -> int:
    return os.stat(f"/run/netns/{ns}").st_ino


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def root_links():
    """Root-namespace links before anything is built; the cluster is removed at the end."""
    before = _root_links()
    try:
        yield before
    finally:
        netns.down()


@pytest.fixture
def two_nodes(root_links):
    """A 2-node cluster at RATE (reused when one is already up)."""
    st = cluster.status()
    if not (st["complete"] and st["num_nodes"] == 2
            and all(n["upload_bit"] == RATE_BITS == n["download_bit"] for n in st["nodes"])):
        st = cluster.up(2, RATE)
    return st


# --------------------------------------------------------------------------- no root needed


@pytest.mark.timeout(10)
def test_parse_rate():
    assert netns.parse_rate("100mbit") == 100_000_000
    assert netns.parse_rate("1gbit") == 1_000_000_000
    assert netns.parse_rate("500kbit") == 500_000
    assert netns.parse_rate("2.5gbit") == 2_500_000_000
    assert netns.parse_rate("1Gbit") == 1_000_000_000
    assert netns.parse_rate("10mbps") == 80_000_000  # tc: bps = bytes per second
    assert netns.parse_rate(5e6) == 5_000_000
    for bad in ("fast", "100", "100mb", "-5mbit", "0mbit", "mbit", "1e20gbit", ""):
        with pytest.raises(ValueError, match="invalid rate"):
            netns.parse_rate(bad)
    assert netns.format_rate(2_500_000_000) == "2.5gbit"
    assert netns.format_rate(100_000_000) == "100mbit"
    assert netns.burst_bytes(100_000_000) == 64 * 1024
    assert netns.burst_bytes(1_000_000_000) == 500_000
    assert netns.parse_time("5ms") == pytest.approx(0.005)
    with pytest.raises(ValueError, match="invalid delay"):
        netns.parse_time("5")


@pytest.mark.timeout(10)
def test_missing_prerequisites_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(cluster.PrerequisiteError) as info:
        netns.check_prerequisites()
    msg = str(info.value)
    assert "root" in msg and "'ip'" in msg and "'tc'" in msg and "iproute2" in msg
    for argv in (["status"], ["down"], ["up", "--nodes", "2", "--rate", RATE], ["run", "--", "true"]):
        assert cli.main(argv) == 2
        assert "root" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_cli_bad_rate_names_value(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["up", "--nodes", "2", "--rate", "fast"])
    assert info.value.code == 2
    assert "'fast'" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_add_cluster_parser_wiring():
    import argparse

    parser = argparse.ArgumentParser(prog="zpp")
    sub = parser.add_subparsers(dest="command")
    cli.add_cluster_parser(sub)
    args = parser.parse_args(["cluster", "run", "--nodes", "2", "--ranks-per-node", "2",
                              "--backend", "mpi", "--timeout", "5", "--", "python", "-c", "pass"])
    assert args.func is cli.cmd_run
    assert (args.nodes, args.ranks_per_node, args.backend, args.timeout) == (2, 2, "mpi", 5.0)
    assert [a for a in args.cmd if a != "--"] == ["python", "-c", "pass"]
    args = parser.parse_args(["cluster", "up", "--nodes", "3", "--rate", "2.5gbit"])
    assert args.func is cli.cmd_up and args.nodes == 3 and args.rate == "2.5gbit"
    # zpp/cli.py's COMMANDS convention: HELP, add_arguments(parser), run(args, argv)
    parser = argparse.ArgumentParser(prog="zpp")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("cluster", help=cli.HELP)
    cli.add_arguments(p)
    p.set_defaults(handler=cli.run)
    args = parser.parse_args(["cluster", "down"])
    assert args.handler is cli.run and args.func is cli.cmd_down


@pytest.mark.timeout(30)
def test_cluster_help_is_for_users():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "zpp", "cluster", "--help"], capture_output=True, text=True,
                         timeout=20, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr
    assert "zpp cluster up --nodes 2 --rate 100mbit" in res.stdout and "Needs root and iproute2" in res.stdout
    for developer_text in ("``", "COMMANDS", "add_arguments", "Wiring", "args.func"):
        assert developer_text not in res.stdout, developer_text


def test_launcher_refuses_foreign_namespaces(tmp_path):
    path = launch.write_launcher(str(tmp_path))
    for host in ("other", "zpp-sw", "zpp-n", "zpp-n1x", "zpp-n1;true", "zpp-n-1", "zpp-keepme-test"):
        res = subprocess.run(["sh", path, host, "echo", "ran"], capture_output=True, text=True, timeout=10)
        assert res.returncode == 255 and "refusing" in res.stderr and "ran" not in res.stdout, host


# --------------------------------------------------------------------------- cluster


@needs_cluster
@pytest.mark.timeout(30)
def test_up_and_status(two_nodes):
    st = cluster.status()
    assert st["up"] and st["complete"] and st["num_nodes"] == 2
    assert [n["namespace"] for n in st["nodes"]] == ["zpp-n0", "zpp-n1"]
    assert [n["address"] for n in st["nodes"]] == ["198.18.0.1", "198.18.0.2"]
    for n in st["nodes"]:
        assert n["upload_bit"] == RATE_BITS and n["download_bit"] == RATE_BITS
        assert n["problems"] == []
    names = netns.list_namespaces()
    assert {"zpp-sw", "zpp-n0", "zpp-n1"} <= set(names)
    res = _cli("status")
    assert res.returncode == 0, res.stderr
    assert "198.18.0.2" in res.stdout and "zpp-n1" in res.stdout and "20mbit" in res.stdout


_RECEIVER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(20)
total, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    total += len(b)
print(total, time.perf_counter() - t0, flush=True)
"""

_SENDER = r"""
import socket, sys
n = int(sys.argv[3])
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
buf = b"\0" * (1 << 16)
while n > 0:
    k = min(n, len(buf)); c.sendall(buf[:k]); n -= k
c.shutdown(socket.SHUT_WR)
c.recv(1)
c.close()
"""


def measure_bits_per_s(src: int, dst: int, nbytes: int, port: int = 45678) -> float:
    """TCP goodput from node ``src`` to node ``dst`` (receiver-side clock)."""
    recv = subprocess.Popen(["ip", "netns", "exec", netns.node_ns(dst), sys.executable, "-c", _RECEIVER, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
        subprocess.run(["ip", "netns", "exec", netns.node_ns(src), sys.executable, "-c", _SENDER,
                        netns.node_address(dst), str(port), str(nbytes)], check=True, timeout=30)
        total, secs = recv.stdout.readline().split()
        recv.wait(timeout=10)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    assert int(total) == nbytes
    return int(total) * 8 / float(secs)


@needs_cluster
@pytest.mark.timeout(40)
def test_rate_is_enforced(two_nodes):
    nbytes = 3_000_000  # ~1.2 s at 20 Mbit/s
    for src, dst in ((0, 1), (1, 0)):
        bps = measure_bits_per_s(src, dst, nbytes)
        assert 0.5 * RATE_BITS <= bps <= 1.1 * RATE_BITS, f"{src}->{dst}: {bps / 1e6:.2f} Mbit/s"


_TORCH_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    ino = os.stat("/proc/self/ns/net").st_ino
    print(f"RESULT rank={rank} world={world} sum={t.item():g} netns={ino} local={os.environ['LOCAL_RANK']} "
          f"backend={os.environ['ZPP_COMM_BACKEND']} rpn={os.environ['ZPP_RANKS_PER_NODE']}", flush=True)
    dist.destroy_process_group()
""")

_MPI_SCRIPT = textwrap.dedent("""
    import os
    from mpi4py import MPI
    import numpy as np
    comm = MPI.COMM_WORLD
    x = np.array([comm.rank + 1.0]); y = np.zeros(1)
    comm.Allreduce(x, y)
    ino = os.stat("/proc/self/ns/net").st_ino
    print(f"RESULT rank={comm.rank} world={comm.size} sum={y[0]:g} netns={ino} "
          f"backend={os.environ['ZPP_COMM_BACKEND']} rpn={os.environ['ZPP_RANKS_PER_NODE']}", flush=True)
""")


def _results(text: str) -> dict[int, dict[str, str]]:
    out = {}
    for line in text.splitlines():
        if "RESULT" in line:
            fields = dict(kv.split("=", 1) for kv in line.split("RESULT", 1)[1].split())
            out[int(fields["rank"])] = fields
    return out


@needs_cluster
@pytest.mark.timeout(90)
def test_run_torch_gloo_all_reduce(two_nodes, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(_TORCH_SCRIPT)
    out, err = io.StringIO(), io.StringIO()
    rc = cluster.run([sys.executable, str(script)], nodes=2, ranks_per_node=1, backend="torch",
                     timeout=75, stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    # each node's hosts file names every peer: torch's store resolves them, so no c10d warning
    assert "hostname of the client socket" not in err.getvalue(), err.getvalue()
    # rank 0's stdout arrives unprefixed on stdout; rank 1's prefixed on stderr
    r0 = _results(out.getvalue())
    r1 = _results(err.getvalue())
    assert list(r0) == [0] and out.getvalue().startswith("RESULT rank=0"), out.getvalue()
    assert 1 in r1 and "[rank 1] RESULT" in err.getvalue()
    res = {**r0, 1: r1[1]}
    for r in (0, 1):
        assert res[r]["sum"] == "3" and res[r]["world"] == "2"
        assert res[r]["backend"] == "torch" and res[r]["rpn"] == "1"
        assert int(res[r]["netns"]) == _ns_inode(netns.node_ns(r))  # each rank in its node


@needs_cluster
@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed")
def test_run_mpi_all_reduce(two_nodes, tmp_path):
    try:
        launch.find_mpiexec()
    except cluster.PrerequisiteError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "mpi_allreduce.py"
    script.write_text(_MPI_SCRIPT)
    out, err = io.StringIO(), io.StringIO()
    rc = cluster.run([sys.executable, str(script)], nodes=2, ranks_per_node=2, backend="mpi",
                     timeout=45, stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    assert list(_results(out.getvalue())) == [0], out.getvalue()
    res = {**_results(err.getvalue()), **_results(out.getvalue())}
    assert sorted(res) == [0, 1, 2, 3], err.getvalue()
    for r in range(4):
        assert res[r]["sum"] == "10" and res[r]["world"] == "4" and res[r]["backend"] == "mpi"
        assert int(res[r]["netns"]) == _ns_inode(netns.node_ns(r // 2))  # 2 ranks per node


@needs_cluster
@pytest.mark.timeout(30)
def test_run_timeout_kills_everything(two_nodes):
    err = io.StringIO()
    t0 = time.monotonic()
    rc = cluster.run(["sh", "-c", "sleep 60 & sleep 60"], nodes=2, timeout=1.5,
                     stdout=io.StringIO(), stderr=err)
    assert rc == launch.TIMEOUT_EXIT and "timed out" in err.getvalue()
    assert time.monotonic() - t0 < 15
    for i in range(2):
        pids = subprocess.run(["ip", "netns", "pids", netns.node_ns(i)], capture_output=True, text=True).stdout
        assert pids.split() == [], f"left in {netns.node_ns(i)}: {pids}"


@needs_cluster
@pytest.mark.timeout(30)
def test_run_worst_exit_code_and_errors(two_nodes):
    rc = cluster.run(["sh", "-c", 'exit $((RANK + 3))'], nodes=2, stdout=io.StringIO(), stderr=io.StringIO())
    assert rc == 4
    with pytest.raises(cluster.ClusterError, match="3 requested"):
        cluster.run(["true"], nodes=3)
    res = _cli("run", "--nodes", "5", "--", "true")
    assert res.returncode == 1 and "5 requested" in res.stderr
    res = _cli("run", "--", "sh", "-c", 'echo "out $RANK/$WORLD_SIZE $MASTER_ADDR $GLOO_SOCKET_IFNAME"')
    assert res.returncode == 0, res.stderr
    assert res.stdout == "out 0/2 198.18.0.1 zpp-eth\n"  # defaults: all nodes, 1 rank each
    assert "[rank 1] out 1/2 198.18.0.1 zpp-eth" in res.stderr


@needs_cluster
@pytest.mark.timeout(30)
def test_delay_needs_netem(two_nodes):
    if netns.netem_available(refresh=True):
        st = cluster.up(2, RATE, delay="5ms")
        assert all(n["delay_s"] == pytest.approx(0.005, rel=0.05) for n in st["nodes"])
        return
    res = _cli("up", "--nodes", "2", "--rate", RATE, "--delay", "5ms")
    assert res.returncode == 2
    assert "netem is not available on this kernel" in res.stderr
    with pytest.raises(cluster.NetemUnavailableError, match="netem"):
        cluster.up(2, RATE, delay="5ms")
    # the refused request left the running cluster alone, and the probe left nothing behind
    st = cluster.status()
    assert st["complete"] and st["num_nodes"] == 2 and not st["other_namespaces"]


@needs_cluster
@pytest.mark.timeout(30)
def test_second_up_replaces_first(two_nodes):
    st = cluster.up(3, "100mbit")
    assert st["complete"] and st["num_nodes"] == 3
    assert {n["upload_bit"] for n in st["nodes"]} == {100_000_000}
    assert {n["download_bit"] for n in st["nodes"]} == {100_000_000}
    res = _cli("up", "--nodes", "2", "--rate", "1gbit")
    assert res.returncode == 0, res.stderr
    st = cluster.status()
    assert st["num_nodes"] == 2 and {n["upload_bit"] for n in st["nodes"]} == {1_000_000_000}
    assert netns.owned_namespaces() == ["zpp-n0", "zpp-n1", "zpp-sw"]


@needs_cluster
@pytest.mark.timeout(30)
def test_down_leaves_nothing_behind(root_links):
    cluster.up(2, RATE)
    hosts = [os.path.join(netns.NETNS_ETC, netns.node_ns(i), "hosts") for i in range(2)]
    assert all("198.18.0.2 zpp-n1" in open(h).read() for h in hosts), hosts
    assert DECOY_NS not in netns.list_namespaces(), DECOY_NS  # never remove what we did not make
    subprocess.run(["ip", "netns", "add", DECOY_NS], check=True)
    try:
        res = _cli("down")
        assert res.returncode == 0, res.stderr
        names = netns.list_namespaces()
        assert DECOY_NS in names  # prefixed but not ours: untouched
        assert [n for n in names if netns.is_owned_namespace(n)] == []
        assert not any(os.path.exists(os.path.dirname(h)) for h in hosts), hosts
        assert _root_links() == root_links
        assert cluster.status()["up"] is False
        res = _cli("status")
        assert res.returncode == 0 and res.stdout.strip() == "no cluster"
        with pytest.raises(cluster.ClusterError, match="no cluster is up"):
            cluster.run(["true"])
        assert cluster.down() == []  # idempotent
    finally:
        subprocess.run(["ip", "netns", "del", DECOY_NS], capture_output=True)
