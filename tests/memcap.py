"""A memory cgroup for one command: the cap under which ``tests/test_memory_cap.py`` and
``perf/nvme_cap.py`` train a job.

The limit covers everything the command starts (the launcher, every rank, their threads and
the page cache they cause) and swap is kept out of it, so a job that needs more is killed by
the kernel's memcg OOM killer rather than slowed. Both cgroup versions: v1's ``memory``
controller (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` where swap accounting
is on) and v2's unified tree (``memory.max``, ``memory.swap.max``). Creating one changes the
host: root only, and the tests that do are opt-in (``ZPP_TEST_MEMCAP=1``; ``.ci/run`` sets it).
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

MEMCAP_ENV = "ZPP_TEST_MEMCAP"
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def skip_reason() -> str | None:
    """Why a capped run cannot be made here (None when it can)."""
    if os.environ.get(MEMCAP_ENV) != "1":
        return (f"creates a memory cgroup on this machine; set {MEMCAP_ENV}=1 to run it "
                "(needs root and the cgroup memory controller; .ci/run sets it)")
    if os.geteuid() != 0:
        return f"{MEMCAP_ENV}=1 but not root: a memory cgroup needs root"
    if not (V1 / "memory.limit_in_bytes").exists() and "memory" not in _v2_controllers():
        return f"{MEMCAP_ENV}=1 but this machine has no cgroup memory controller (v1 {V1} or v2 {V2})"
    return None


def _v2_controllers() -> str:
    try:
        return (V2 / "cgroup.subtree_control").read_text()
    except OSError:
        return ""


class Cgroup:
    """A memory cgroup of ``limit`` bytes (None: no limit, to measure a job's peak) for one
    command; ``remove()`` it after (a context manager does)."""

    def __init__(self, name: str, limit: int | None) -> None:
        self.v1 = (V1 / "memory.limit_in_bytes").exists()
        self.path = (V1 if self.v1 else V2) / name
        self.path.mkdir()
        if limit is not None:
            (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))
            if self.v1 and (self.path / "memory.memsw.limit_in_bytes").exists():
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no escape into swap
            elif not self.v1:
                (self.path / "memory.swap.max").write_text("0")

    def __enter__(self) -> "Cgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def peak(self) -> int:
        """The most memory the cgroup's processes held at once, in bytes."""
        return int((self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")).read_text())

    def failcnt(self) -> int:
        """How often the limit was hit (v1) or the OOM killer ran in the cgroup (v2)."""
        if self.v1:
            return int((self.path / "memory.failcnt").read_text())
        return self.oom_kills() or 0

    def oom_kills(self) -> int | None:
        """Processes the memcg OOM killer ended in the cgroup (None where the kernel does not say)."""
        name = "memory.oom_control" if self.v1 else "memory.events"
        try:
            fields = dict(line.split() for line in (self.path / name).read_text().splitlines())
        except OSError:
            return None
        return int(fields["oom_kill"]) if "oom_kill" in fields else None

    def run(self, cmd: list[str], timeout: float, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside the cgroup (the shell joins it, then execs the command)."""
        procs = self.path / "cgroup.procs"
        shell = f"echo $$ > {procs} && exec \"$@\""
        return subprocess.run(["sh", "-c", shell, "sh", *cmd], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # its last processes are still leaving
                time.sleep(0.1)
