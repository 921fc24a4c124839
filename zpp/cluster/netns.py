"""Build, inspect and tear down an emulated multi-node cluster with network namespaces.

Topology (every name carries :data:`PREFIX`)::

    zpp-n0 [zpp-eth 198.18.0.1/24] --veth-- [zpp-s0] \
    zpp-n1 [zpp-eth 198.18.0.2/24] --veth-- [zpp-s1]  >- bridge zpp-br (namespace zpp-sw)
    ...                                              /

* one network namespace per node (``zpp-n<i>``), with ``lo`` up and one veth named
  :data:`NODE_IF` (the same name in every node, so one interface variable fits all ranks);
* the veth peers (``zpp-s<i>``) are ports of a Linux bridge in a separate "switch"
  namespace (``zpp-sw``), so nothing is created in the root namespace;
* each node link is shaped in both directions with ``tbf``: egress of the node-side veth is
  the node's upload, egress of the switch-side veth its download;
* an optional one-way ``delay`` is added with ``netem`` on the upload side only (so the
  latency between two nodes is ``delay`` each way), where the kernel has netem;
* each node gets a hosts file (``/etc/netns/zpp-n<i>/hosts``, which ``ip netns exec`` mounts
  over ``/etc/hosts``) naming every node's address, plain and IPv4-mapped, and loopback:
  inside a namespace no DNS server is reachable, so without it every reverse lookup fails
  (torch's TCPStore printed "The hostname of the client socket cannot be retrieved" on
  every rank).

The cluster's state is read back from the live namespaces and qdiscs; no state file.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Sequence

PREFIX = "zpp-"
SWITCH_NS = PREFIX + "sw"
BRIDGE = PREFIX + "br"
NODE_IF = PREFIX + "eth"
NODE_NS_FMT = PREFIX + "n{}"
SWITCH_IF_FMT = PREFIX + "s{}"
PROBE_NS_FMT = PREFIX + "probe{}"
SUBNET_BASE = "198.18.0."
SUBNET_PREFIXLEN = 24
MAX_NODES = 253  # 198.18.0.1 .. 198.18.0.253 in one /24
TBF_LATENCY = "50ms"
MIN_BURST_BYTES = 64 * 1024
BURST_SECONDS = 0.004

NODE_NS_RE = re.compile(r"^" + re.escape(PREFIX) + r"n(\d+)$")
# Every namespace this module may create; `down` removes exactly the names matching it.
OWNED_NS_RE = re.compile(r"^" + re.escape(PREFIX) + r"(?:sw|n\d+|probe\d+)$")

IFNAMSIZ = 15
for _name in (SWITCH_NS, BRIDGE, NODE_IF, SWITCH_IF_FMT.format(MAX_NODES - 1)):
    assert len(_name) <= IFNAMSIZ, _name


class ClusterError(RuntimeError):
    """A cluster operation failed. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class PrerequisiteError(ClusterError):
    """Missing root, iproute2, or a kernel feature."""

    exit_code = 2


class NetemUnavailableError(PrerequisiteError):
    """``--delay`` asked for, but the kernel has no netem qdisc."""


class CommandError(ClusterError):
    """An ``ip``/``tc`` (or other) command failed."""

    def __init__(self, cmd: Sequence[str], returncode: int, stderr: str, stdout: str = ""):
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        detail = (stderr or stdout).strip() or "(no output)"
        super().__init__(
            f"command failed (exit {returncode}): {' '.join(self.cmd)}\n  {detail}"
        )


# --------------------------------------------------------------------------- prerequisites


def missing_prerequisites() -> list[str]:
    """What this machine lacks to build a cluster (empty when everything is there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root privileges (network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN; run as root)")
    tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if tools:
        missing.append(
            f"the iproute2 command{'s' if len(tools) > 1 else ''} {' and '.join(repr(t) for t in tools)} "
            "(install iproute2, e.g. `apt-get install iproute2`)"
        )
    return missing


def check_prerequisites() -> None:
    """Raise :class:`PrerequisiteError` naming what is missing."""
    missing = missing_prerequisites()
    if missing:
        raise PrerequisiteError("zpp cluster needs " + "; and ".join(missing))


# --------------------------------------------------------------------------- command runner


def sh(
    args: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 30.0,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Run a command (``ip``/``tc``/...), capturing output.

    With ``check`` a non-zero exit raises :class:`CommandError` quoting the command and its
    stderr. A missing executable or a hang raises :class:`ClusterError` too.
    """
    args = [str(a) for a in args]
    try:
        proc = subprocess.run(
            args,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise PrerequisiteError(f"cannot run {' '.join(args)}: {args[0]!r} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"command timed out after {timeout:g} s: {' '.join(args)}") from exc
    if check and proc.returncode != 0:
        raise CommandError(args, proc.returncode, proc.stderr, proc.stdout)
    return proc


def _json(args: Sequence[str]) -> Any:
    out = sh(args).stdout.strip()
    if not out:
        return []
    try:
        return json.loads(out)
    except json.JSONDecodeError as exc:
        raise ClusterError(f"cannot parse JSON from {' '.join(args)}: {out[:200]!r}") from exc


# --------------------------------------------------------------------------- value parsing

_NUM = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?"
_RATE_RE = re.compile(r"^\s*" + _NUM + r"\s*([A-Za-z]+)\s*$")
# tc's rate units (case-insensitive, as tc parses them): *bit = bits/s, *bps = BYTES/s.
_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
MIN_RATE_BITS = 1000
MAX_RATE_BITS = 10**12


def parse_rate(value: str | int | float) -> int:
    """Parse a tc-style rate (``100mbit``, ``1gbit``, ``500kbit``, ``2.5gbit``) to bits/s.

    Units follow tc: ``bit/kbit/mbit/gbit/tbit`` (and ``kibit``...) are bits per second,
    ``bps/kbps/mbps/gbps`` are BYTES per second. A string needs a unit. From Python an int or
    float is taken as bits per second.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid rate {value!r}")
    if isinstance(value, (int, float)):
        bits = float(value)
        shown = repr(value)
    else:
        shown = repr(value)
        m = _RATE_RE.match(str(value))
        unit = m.group(3).lower() if m else None
        if not m or unit not in _RATE_UNITS:
            raise ValueError(
                f"invalid rate {shown}: expected a number with a tc rate unit, "
                "e.g. 500kbit, 100mbit, 1gbit, 2.5gbit"
            )
        mantissa = float(m.group(1))
        exponent = int(m.group(2)) if m.group(2) else 0
        bits = mantissa * 10.0**exponent * _RATE_UNITS[unit]
    if not math.isfinite(bits) or bits < MIN_RATE_BITS or bits > MAX_RATE_BITS:
        raise ValueError(
            f"invalid rate {shown}: must be between {format_rate(MIN_RATE_BITS)} and "
            f"{format_rate(MAX_RATE_BITS)}"
        )
    return int(round(bits))


def format_rate(bits: float) -> str:
    """Bits per second as a tc-style string: 100000000 -> ``100mbit``, 2.5e9 -> ``2.5gbit``."""
    for unit, mult in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= mult:
            return f"{bits / mult:.6g}{unit}"
    return f"{bits:.6g}bit"


_TIME_RE = re.compile(r"^\s*" + _NUM + r"\s*([A-Za-z]+)\s*$")
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
}
MAX_DELAY_S = 10.0


def parse_time(value: str | int | float) -> float:
    """Parse a tc-style time (``5ms``, ``250us``, ``0.1s``) to seconds. Python numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError(f"invalid delay {value!r}")
    if isinstance(value, (int, float)):
        secs = float(value)
    else:
        m = _TIME_RE.match(str(value))
        unit = m.group(3).lower() if m else None
        if not m or unit not in _TIME_UNITS:
            raise ValueError(f"invalid delay {value!r}: expected e.g. 5ms, 250us, 0.1s")
        exponent = int(m.group(2)) if m.group(2) else 0
        secs = float(m.group(1)) * 10.0**exponent * _TIME_UNITS[unit]
    if not math.isfinite(secs) or secs <= 0 or secs > MAX_DELAY_S:
        raise ValueError(f"invalid delay {value!r}: must be > 0 and at most {MAX_DELAY_S:g}s")
    return secs


def format_time(secs: float) -> str:
    if secs >= 1:
        return f"{secs:.6g}s"
    if secs >= 1e-3:
        return f"{secs * 1e3:.6g}ms"
    return f"{secs * 1e6:.6g}us"


def burst_bytes(rate_bits: int) -> int:
    """tbf burst: max(64 KiB, 4 ms worth of the rate)."""
    return max(MIN_BURST_BYTES, int(math.ceil(rate_bits / 8 * BURST_SECONDS)))


# --------------------------------------------------------------------------- names


def node_ns(i: int) -> str:
    return NODE_NS_FMT.format(i)


def switch_if(i: int) -> str:
    return SWITCH_IF_FMT.format(i)


def node_address(i: int) -> str:
    if not 0 <= i < MAX_NODES:
        raise ValueError(f"node index {i} out of range 0..{MAX_NODES - 1}")
    return f"{SUBNET_BASE}{i + 1}"


def is_owned_namespace(name: str) -> bool:
    return bool(OWNED_NS_RE.match(name))


def list_namespaces() -> list[str]:
    """All network namespace names on the machine (``ip netns list``)."""
    entries = _json(["ip", "-j", "netns", "list"])
    return [e["name"] for e in entries if isinstance(e, dict) and "name" in e]


def owned_namespaces() -> list[str]:
    return sorted(n for n in list_namespaces() if is_owned_namespace(n))


def node_namespaces() -> dict[int, str]:
    """{index: namespace} of the node namespaces that exist now."""
    out = {}
    for n in list_namespaces():
        m = NODE_NS_RE.match(n)
        if m:
            out[int(m.group(1))] = n
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- netem probe

_netem_cache: bool | None = None


def netem_available(refresh: bool = False) -> bool:
    """Whether the kernel accepts a ``netem`` qdisc.

    Probed for real: a scratch namespace of ours gets a netem qdisc on its ``lo``; the
    namespace is deleted afterwards whatever happens. (Loading sch_netem on demand, if it is
    a module, happens as part of the probe, as it would for the real qdisc.)
    """
    global _netem_cache
    if _netem_cache is not None and not refresh:
        return _netem_cache
    check_prerequisites()
    ns = PROBE_NS_FMT.format(os.getpid())
    sh(["ip", "netns", "del", ns], check=False)
    sh(["ip", "netns", "add", ns])
    try:
        res = sh(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
        ok = res.returncode == 0
        if ok:
            sh(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
    finally:
        sh(["ip", "netns", "del", ns], check=False)
    _netem_cache = ok
    return ok


def require_netem() -> None:
    if not netem_available():
        raise NetemUnavailableError(
            "--delay needs the netem qdisc, but netem is not available on this kernel "
            f"({os.uname().release}); bring the cluster up without --delay (rate shaping "
            "with tbf works without it)"
        )


# --------------------------------------------------------------------------- shaping


def shape_link(ns: str, dev: str, rate_bits: int, delay_s: float | None = None) -> None:
    """Shape egress of ``dev`` in ``ns``: tbf at ``rate_bits``, optionally behind netem delay."""
    tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst_bytes(rate_bits)), "latency", TBF_LATENCY]
    if delay_s:
        # netem queue must hold a delay's worth of packets at the link rate.
        limit = max(1000, int(rate_bits / 8 * delay_s / 1500 * 4) + 100)
        sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem",
            "delay", f"{int(round(delay_s * 1e6))}us", "limit", str(limit)])
        sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
    else:
        sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *tbf])


def read_shaping(ns: str, dev: str) -> dict:
    """Read back ``tc qdisc show``: {'rate_bit': int|None, 'delay_s': float|None, 'qdiscs': [...]}."""
    try:
        qdiscs = _json(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev])
    except CommandError:
        return {"rate_bit": None, "delay_s": None, "burst": None, "qdiscs": []}
    rate = delay = burst = None
    kinds = []
    for q in qdiscs:
        kind = q.get("kind")
        kinds.append(kind)
        opts = q.get("options", {}) or {}
        if kind == "tbf" and rate is None:
            if "rate" in opts:
                rate = int(opts["rate"]) * 8  # tc -j reports bytes per second
            burst = opts.get("burst")
        elif kind == "netem" and delay is None:
            d = opts.get("delay")
            if isinstance(d, dict):
                d = d.get("delay")
            if isinstance(d, (int, float)) and d > 0:
                delay = float(d)
    return {"rate_bit": rate, "delay_s": delay, "burst": burst, "qdiscs": kinds}


# --------------------------------------------------------------------------- up / down / status


def _kill_namespace_processes(names: Sequence[str], grace: float = 3.0) -> list[int]:
    """SIGTERM (then SIGKILL) processes still running inside our namespaces."""
    pids: list[int] = []
    for ns in names:
        res = sh(["ip", "netns", "pids", ns], check=False)
        pids += [int(p) for p in res.stdout.split() if p.isdigit()]
    pids = [p for p in pids if p != os.getpid()]
    if not pids:
        return []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            if not [p for p in pids if _alive(p)]:
                return pids
            time.sleep(0.05)
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


NETNS_ETC = "/etc/netns"


def write_hosts(nodes: int, etc: str = NETNS_ETC) -> None:
    """Each node's ``<etc>/zpp-n<i>/hosts``: loopback and every node's address (plain and
    IPv4-mapped, as a dual-stack socket reports a peer) under its namespace's name."""
    lines = ["127.0.0.1 localhost", "::1 localhost", "::ffff:127.0.0.1 localhost"]
    for i in range(nodes):
        lines += [f"{node_address(i)} {node_ns(i)}", f"::ffff:{node_address(i)} {node_ns(i)}"]
    for i in range(nodes):
        folder = os.path.join(etc, node_ns(i))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")


def remove_hosts(etc: str = NETNS_ETC) -> None:
    """Remove the folders :func:`write_hosts` made (our names only)."""
    if not os.path.isdir(etc):
        return
    for name in os.listdir(etc):
        if OWNED_NS_RE.match(name):
            shutil.rmtree(os.path.join(etc, name), ignore_errors=True)


def down(*, kill_processes: bool = True) -> list[str]:
    """Remove every namespace this module owns (``zpp-sw``, ``zpp-n<i>``, probes), their
    hosts files, and nothing else.

    Deleting a namespace destroys the veths and the bridge inside it. Processes still running
    in those namespaces are terminated first (``kill_processes``), otherwise their network
    would linger unnamed. Returns the names removed. Idempotent.
    """
    check_prerequisites()
    names = owned_namespaces()
    if kill_processes and names:
        _kill_namespace_processes(names)
    errors = []
    for ns in names:
        res = sh(["ip", "netns", "del", ns], check=False)
        if res.returncode != 0 and ns in list_namespaces():
            errors.append(f"ip netns del {ns}: {res.stderr.strip()}")
    remove_hosts()
    if errors:
        raise ClusterError("could not remove: " + "; ".join(errors))
    return names


def up(nodes: int, rate: str | int | float, delay: str | float | None = None) -> dict:
    """Build a cluster of ``nodes`` namespaces, each link shaped to ``rate`` both ways.

    Any existing cluster is torn down first (a second ``up`` replaces the first). Arguments
    are validated before anything is torn down. On failure, whatever was built is removed.
    Returns :func:`status`.
    """
    check_prerequisites()
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"invalid node count {nodes!r}: must be an integer from 1 to {MAX_NODES}")
    rate_bits = parse_rate(rate)
    delay_s = parse_time(delay) if delay not in (None, "", 0) else None
    if delay_s is not None:
        require_netem()

    down()
    try:
        sh(["ip", "netns", "add", SWITCH_NS])
        sh(["ip", "-n", SWITCH_NS, "link", "set", "lo", "up"])
        sh(["ip", "-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0",
            "forward_delay", "0"])
        sh(["ip", "-n", SWITCH_NS, "link", "set", BRIDGE, "addrgenmode", "none", "up"])
        for i in range(nodes):
            ns, sif = node_ns(i), switch_if(i)
            sh(["ip", "netns", "add", ns])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Create the pair inside the switch namespace with the peer put straight into the
            # node namespace: nothing ever appears in the root namespace.
            sh(["ip", "-n", SWITCH_NS, "link", "add", sif, "type", "veth",
                "peer", "name", NODE_IF, "netns", ns])
            # addrgenmode none: no IPv6 link-local chatter through the shaped links.
            sh(["ip", "-n", SWITCH_NS, "link", "set", sif, "master", BRIDGE, "addrgenmode", "none", "up"])
            sh(["ip", "-n", ns, "link", "set", NODE_IF, "addrgenmode", "none"])
            sh(["ip", "-n", ns, "addr", "add", f"{node_address(i)}/{SUBNET_PREFIXLEN}", "dev", NODE_IF])
            sh(["ip", "-n", ns, "link", "set", NODE_IF, "up"])
            shape_link(ns, NODE_IF, rate_bits, delay_s)  # upload (+ one-way delay)
            shape_link(SWITCH_NS, sif, rate_bits)  # download
        write_hosts(nodes)
    except BaseException:
        try:
            down()
        except Exception:
            pass
        raise
    return status()


def status() -> dict:
    """Describe the cluster from the live namespaces and qdiscs.

    Returns ``{"up": bool, "complete": bool, "nodes": [...], ...}``; ``up`` is False when
    none of our namespaces exists. Each node lists namespace, address, upload/download rate
    (bits/s, read back from ``tc qdisc show``), delay and any problems found.
    """
    check_prerequisites()
    owned = owned_namespaces()
    nodes_ns = node_namespaces()
    has_switch = SWITCH_NS in owned
    nodes = []
    for i, ns in nodes_ns.items():
        problems = []
        address = None
        try:
            addrs = _json(["ip", "-n", ns, "-j", "-4", "addr", "show", "dev", NODE_IF])
            for link in addrs:
                for a in link.get("addr_info", []):
                    if a.get("family") == "inet":
                        address = a.get("local")
                        break
        except CommandError:
            problems.append(f"no interface {NODE_IF}")
        if address is None and not problems:
            problems.append(f"no IPv4 address on {NODE_IF}")
        upl = read_shaping(ns, NODE_IF)
        dnl = read_shaping(SWITCH_NS, switch_if(i)) if has_switch else {"rate_bit": None}
        if upl["rate_bit"] is None:
            problems.append("upload not shaped")
        if dnl["rate_bit"] is None:
            problems.append("download not shaped")
        nodes.append({
            "index": i,
            "namespace": ns,
            "interface": NODE_IF,
            "address": address,
            "switch_port": switch_if(i),
            "upload_bit": upl["rate_bit"],
            "download_bit": dnl["rate_bit"],
            "upload": format_rate(upl["rate_bit"]) if upl["rate_bit"] else None,
            "download": format_rate(dnl["rate_bit"]) if dnl["rate_bit"] else None,
            "burst_bytes": upl["burst"],
            "delay_s": upl["delay_s"],
            "problems": problems,
        })
    contiguous = list(nodes_ns) == list(range(len(nodes_ns)))
    complete = bool(nodes) and has_switch and contiguous and not any(n["problems"] for n in nodes)
    others = [n for n in owned if n != SWITCH_NS and not NODE_NS_RE.match(n)]
    return {
        "up": bool(owned),
        "complete": complete,
        "prefix": PREFIX,
        "switch": SWITCH_NS if has_switch else None,
        "bridge": BRIDGE,
        "interface": NODE_IF,
        "subnet": f"{SUBNET_BASE}0/{SUBNET_PREFIXLEN}",
        "num_nodes": len(nodes),
        "nodes": nodes,
        "other_namespaces": others,
    }


def format_status(st: dict) -> str:
    """Human-readable text for :func:`status`'s dict."""
    if not st.get("up"):
        return "no cluster"
    lines = []
    state = "" if st["complete"] else "  [INCOMPLETE]"
    lines.append(
        f"cluster: {st['num_nodes']} node(s), switch namespace {st['switch'] or '(missing)'} "
        f"(bridge {st['bridge']}), node interface {st['interface']}, subnet {st['subnet']}{state}"
    )
    header = f"{'node':>4}  {'namespace':<10} {'address':<15} {'upload':>10} {'download':>10} {'delay':>8}"
    lines.append(header)
    for n in st["nodes"]:
        delay = format_time(n["delay_s"]) if n["delay_s"] else "-"
        lines.append(
            f"{n['index']:>4}  {n['namespace']:<10} {n['address'] or '-':<15} "
            f"{n['upload'] or '-':>10} {n['download'] or '-':>10} {delay:>8}"
            + (f"  ! {', '.join(n['problems'])}" if n["problems"] else "")
        )
    if st.get("other_namespaces"):
        lines.append("other zpp namespaces: " + ", ".join(st["other_namespaces"]))
    return "\n".join(lines)
