"""Which asynchronous I/O path is fastest on this disk: zpp's thread pool, DeepSpeed's libaio op, dd.

    python perf/aio_bench.py --json perf/results/aio_bench.json
    /work/dsenv/bin/python perf/aio_bench.py --json ...   # + DeepSpeed's async_io op (needs libaio-dev)

Each path writes then reads one ``--mib`` MiB range of a file under ``--path`` with direct I/O
(no page cache), ``--repeats`` times; the table has each path's median bandwidth and the
ratio to dd's:

* ``dd``: ``oflag=direct conv=fsync`` / ``iflag=direct``, 1 MiB blocks: the disk's
  sequential bandwidth (perf/nvme_bench.py's reference).
* ``zpp``: :class:`zpp.zero.nvme.SwapFile` as the NVMe tier runs it: ``aio.block_size``
  requests on ``thread_count x queue_depth`` ``pread``/``pwrite`` worker threads, CRC32 of
  every request computed on write and checked on read.
* ``zpp-nocrc``: the same without the CRC32 (what the check costs; zpp always checks).
* ``deepspeed-libaio``: DeepSpeed's ``aio_handle`` (libaio, ``io_submit``/``io_getevents``)
  with the same block size and queue depth, ``intra_op_parallelism`` = ``thread_count``,
  on a page-locked tensor from ``new_cpu_locked_tensor``; only where DeepSpeed and its op load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import runinfo  # noqa: E402
from nvme_bench import disk  # noqa: E402


def zpp_path(root: Path, nbytes: int, aio: dict, crc: bool) -> tuple[float, float]:
    """Seconds to write then read ``nbytes`` through a SwapFile."""
    import torch

    from zpp.zero.nvme import Buffer, Entry, Region, SwapFile
    from zpp.zero.offload_config import AioConfig

    class NoCrc(SwapFile):
        def _pwrite(self, mem, offset):
            self._io(os.pwrite, mem, offset)

        def _pread(self, mem, offset):
            self._io(lambda fd, m, off: os.preadv(fd, [m], off), mem, offset)

    swap = (SwapFile if crc else NoCrc)(str(root), 0, AioConfig(**aio), reserve=nbytes)
    try:
        region = Region(swap.allocate(nbytes), nbytes, (Entry("x", torch.uint8, (nbytes,), 0),))
        src, dst = Buffer(nbytes), Buffer(nbytes)
        src.bytes.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        dst.bytes.zero_()  # faulted in, as the tier's reused buffers are (DeepSpeed's are page-locked)
        t0 = time.perf_counter()
        swap.write(region, src).wait()
        os.fsync(swap.fd)
        t1 = time.perf_counter()
        swap.read(region, dst).wait()
        t2 = time.perf_counter()
        if not torch.equal(src.bytes, dst.bytes):
            raise RuntimeError("zpp: read back differs from what was written")
        return t1 - t0, t2 - t1
    finally:
        swap.close()


def deepspeed_path(root: Path, nbytes: int, aio: dict):
    """Seconds to write then read ``nbytes`` with DeepSpeed's aio_handle, or None."""
    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        op = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - not installed, or its op does not build here
        return f"{type(e).__name__}: {e}"
    h = op.aio_handle(aio["block_size"], aio["queue_depth"], False, True, aio["thread_count"])
    src = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    dst = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    f = root / "deepspeed.bin"
    try:
        t0 = time.perf_counter()
        h.sync_pwrite(src, str(f))
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        t1 = time.perf_counter()
        h.sync_pread(dst, str(f))
        t2 = time.perf_counter()
        if not torch.equal(src, dst):
            raise RuntimeError("deepspeed: read back differs from what was written")
        return t1 - t0, t2 - t1
    finally:
        h.free_cpu_locked_tensor(src)
        h.free_cpu_locked_tensor(dst)
        f.unlink(missing_ok=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "zpp-aio-bench")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--thread-count", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.path.mkdir(parents=True, exist_ok=True)
    nbytes = args.mib << 20
    aio = {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": args.thread_count}
    runs: dict[str, list] = {"dd": [], "zpp": [], "zpp-nocrc": [], "deepspeed-libaio": []}
    skipped = {}
    for _ in range(args.repeats):  # the paths interleaved, so drift of the disk hits them alike
        d = disk(args.path, args.mib)
        runs["dd"].append((nbytes / d["write_Bps"], nbytes / d["read_Bps"]))
        runs["zpp"].append(zpp_path(args.path, nbytes, aio, crc=True))
        runs["zpp-nocrc"].append(zpp_path(args.path, nbytes, aio, crc=False))
        ds = deepspeed_path(args.path, nbytes, aio)
        if isinstance(ds, str):
            skipped["deepspeed-libaio"] = ds
        else:
            runs["deepspeed-libaio"].append(ds)
    rows = []
    for name, times in runs.items():
        if not times:
            continue
        w = nbytes / statistics.median(t[0] for t in times)
        r = nbytes / statistics.median(t[1] for t in times)
        rows.append({"path": name, "write_Bps": w, "read_Bps": r, "runs_s": times})
    dd_w, dd_r = rows[0]["write_Bps"], rows[0]["read_Bps"]
    print(f"# aio_bench: {args.mib} MiB on {args.path}, {args.repeats} repeats (median), aio {aio}")
    print(f"{'path':<18} {'write MB/s':>10} {'/dd':>6} {'read MB/s':>10} {'/dd':>6}")
    for r in rows:
        r["write_over_dd"], r["read_over_dd"] = r["write_Bps"] / dd_w, r["read_Bps"] / dd_r
        print(f"{r['path']:<18} {r['write_Bps'] / 1e6:>10.0f} {r['write_over_dd']:>6.2f} "
              f"{r['read_Bps'] / 1e6:>10.0f} {r['read_over_dd']:>6.2f}")
    for k, why in skipped.items():
        print(f"# {k}: not run ({why})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runinfo.provenance(), "mib": args.mib, "repeats": args.repeats, "aio": aio,
                       "rows": rows, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
