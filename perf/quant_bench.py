"""Throughput of the zpp.quant CPU kernels against memcpy and the plain-torch reference.

    python perf/quant_bench.py [--sizes-mib 1 4 16 64] [--iters 10] [--json FILE]

Throughput is (bytes read + bytes written) / median time. "MiB" is the size of the
floating-point side (the input of quantize/pack_signs, the output of dequantize/
unpack_signs) in the row's dtype. memcpy is torch's copy_ of a 64 MiB fp32 buffer into a
preallocated one, counted the same way (read + write); it is measured before and after the
table and the higher of the two is the "% memcpy" base (the conservative choice when the
machine is shared). Kernels are called directly (the objects behind zpp.quant's dispatch,
which allocate their outputs, as the reference does), symmetric, group_size 2048.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import runinfo  # noqa: E402

from zpp.quant import cpu, reference  # noqa: E402

MIB = 1 << 20
GROUP = 2048


def timings(fn, iters: int, warmup: int = 2, budget_s: float | None = None) -> list[float]:
    """Seconds per call: warmup calls, then up to ``iters`` timed ones (at least 3 when a
    time budget cuts the run short)."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return times


def memcpy_gbps(iters: int) -> float:
    src = torch.randn(64 * MIB // 4)
    dst = torch.empty_like(src)
    t = statistics.median(timings(lambda: dst.copy_(src), iters))
    return 2 * src.numel() * 4 / t / 1e9


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cases(impl, x: torch.Tensor):
    """(name, callable, bytes moved) for one implementation on input x."""
    n, esz = x.numel(), x.element_size()
    groups = -(-n // GROUP)
    out = []
    for bits in (8, 4):
        payload = groups * GROUP * bits // 8 + 4 * groups
        out.append((f"quantize int{bits}", lambda b=bits: impl.quantize(x, b, GROUP, True), n * esz + payload))
        d, s = reference.quantize(x, bits, GROUP, True)
        out.append((
            f"dequantize int{bits}",
            lambda d=d, s=s, b=bits: impl.dequantize(d, s, n, b, GROUP, True, x.dtype),
            payload + n * esz,
        ))
    packed = reference.pack_signs(x)
    out.append(("pack_signs", lambda: impl.pack_signs(x), n * esz + packed.numel()))
    out.append(("unpack_signs", lambda: impl.unpack_signs(packed, n, x.dtype), packed.numel() + n * esz))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=10, help="timed iterations of the cpu kernels")
    ap.add_argument("--ref-iters", type=int, default=3, help="timed iterations of the reference")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)

    kern = cpu.kernels()
    threads = torch.get_num_threads()
    load0 = loadavg()
    mem0 = memcpy_gbps(args.iters)
    rows = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for mib in args.sizes_mib:
            n = mib * MIB // torch.empty(0, dtype=dtype).element_size()
            x = (torch.randn(n) * 3).to(dtype)
            for (name, fast, nbytes), (_, ref, _) in zip(cases(kern, x), cases(reference, x)):
                tf = timings(fast, args.iters)
                tr = timings(ref, args.ref_iters, warmup=1, budget_s=3.0)
                t_fast, t_ref = statistics.median(tf), statistics.median(tr)
                rows.append(dict(op=name, dtype=dname, mib=mib, numel=n, bytes=nbytes,
                                 cpu_s=t_fast, cpu_min_s=min(tf), ref_s=t_ref, ref_min_s=min(tr),
                                 cpu_gbps=nbytes / t_fast / 1e9, ref_gbps=nbytes / t_ref / 1e9,
                                 speedup=t_ref / t_fast))
                print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    mem1 = memcpy_gbps(args.iters)
    load1 = loadavg()
    mem = max(mem0, mem1)
    for r in rows:
        r["frac_memcpy"] = r["cpu_gbps"] / mem

    print(f"torch {torch.__version__}, {threads} threads, {platform.machine()}; "
          f"1-min load average {load0:.1f} at start, {load1:.1f} at end")
    print(f"memcpy (torch copy_, 64 MiB fp32, read+write): {mem0:.2f} GB/s before, "
          f"{mem1:.2f} GB/s after the kernels; base for % memcpy: {mem:.2f} GB/s\n")
    hdr = f"{'op':<16} {'dtype':<9} {'MiB':>4} {'cpu GB/s':>9} {'% memcpy':>9} {'ref GB/s':>9} {'speedup':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['op']:<16} {r['dtype']:<9} {r['mib']:>4} {r['cpu_gbps']:>9.2f} "
              f"{100 * r['frac_memcpy']:>8.1f}% {r['ref_gbps']:>9.3f} {r['speedup']:>7.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            **runinfo.provenance(), memcpy_gbps=mem, memcpy_start_gbps=mem0, memcpy_end_gbps=mem1, threads=threads,
            loadavg_start=load0, loadavg_end=load1, torch=torch.__version__, group_size=GROUP,
            machine=platform.machine(), rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
