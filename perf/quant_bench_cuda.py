"""Bandwidth of the CUDA quantization kernels, relative to torch's device-to-device copy.

For each input size (MiB of the input tensor) and input dtype, times with CUDA events:
torch's copy_ (read + write of the input), and quantize / dequantize (int8, int4), the fused
reduce (k = 4 int4 slices -> int4), sign pack / unpack, and the fused 1-bit error-feedback ops
of OneBitAllReduce (onebit_compress, signs_weighted_sum over k = 8 ranks' sign chunks,
unpack_scaled). Effective bandwidth = bytes read + bytes written per second; "ratio" = that
over the copy's bandwidth at the same size.

onebit_compress is counted at its one-pass minimum (read x and the error, write the error and
the signs) although it makes two passes over x and the error (the scale, a global sum, must be
known before any sign's error can be written): beyond the L2 cache expect a ratio of about
(s + 8.125) / (2 s + 12.125) for s-byte inputs, i.e. 0.60 (fp32) and 0.63 (bf16), less the
one-block halving tree over the fp64 block sums (one per 2048 elements: 32768 at 64 Mi
elements, some 10-20 us against the passes' ~250 us at 256 MiB of fp32).

Launch overhead is kept out of the timings: the GPU first sleeps while the CPU queues all the
timed iterations (torch.cuda._sleep), and events bracket only the queued kernels.

    python perf/quant_bench_cuda.py [--sizes 64 256] [--iters 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _time(fn, iters: int) -> float:
    """Seconds per call of fn, GPU time only."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: longer than queueing the iterations
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="input MiB")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=2048)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant_bench_cuda: no CUDA device")
        return 1

    from zpp.quant import cuda

    K = cuda.kernels()
    G = args.group_size
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  group_size={G}  iters={args.iters}")
    header = f"{'MiB':>5} {'in':>5} {'op':<22} {'us':>9} {'GB/s':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for mib in args.sizes:
        for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            esz = torch.finfo(dtype).bits // 8
            n = mib * 2**20 // esz
            n -= n % G
            x = torch.randn(n, device="cuda").to(dtype)
            y = torch.empty_like(x)
            t = _time(lambda: y.copy_(x), args.iters)
            copy_bw = 2 * n * esz / t

            def report(op, secs, nbytes):
                bw = nbytes / secs
                row = dict(mib=mib, dtype=dname, op=op, us=secs * 1e6, gbps=bw / 1e9, ratio=bw / copy_bw)
                rows.append(row)
                print(f"{mib:>5} {dname:>5} {op:<22} {row['us']:>9.1f} {row['gbps']:>8.0f} {row['ratio']:>6.2f}")

            report("copy", t, 2 * n * esz)
            groups = n // G
            for bits in (8, 4):
                for sym in (True, False):
                    tag = f"{bits}{'s' if sym else 'a'}"
                    q = K.quantize(x, bits, G, sym)
                    payload = q[0].numel() + q[1].numel() * 4
                    t = _time(lambda: K.quantize(x, bits, G, sym), args.iters)
                    report(f"quantize int{tag}", t, n * esz + payload)
                    t = _time(lambda: K.dequantize(q[0], q[1], n, bits, G, sym, dtype), args.iters)
                    report(f"dequantize int{tag}", t, payload + n * esz)
            # qgZ's fused step: 4 int4 slices of n/4 -> sum -> int4
            k = 4
            qs = K.quantize(x, 4, G, True)
            t = _time(lambda: K.reduce_sum(qs[0], qs[1], k, n // k, 4, G, True, 1.0, 4, G, torch.float32), args.iters)
            report("reduce_sum 4xint4->int4", t, n // 2 + groups * 4 + (n // k) // 2 + groups // k * 4)
            t = _time(lambda: K.pack_signs(x), args.iters)
            report("pack_signs", t, n * esz + n // 8)
            p = K.pack_signs(x)
            t = _time(lambda: K.unpack_signs(p, n, dtype), args.iters)
            report("unpack_signs", t, n // 8 + n * esz)
            # 1-bit error feedback: compress n elements; average k = 8 ranks' sign chunks
            # (n / 8 each); expand k scaled chunks back to n elements.
            err = torch.zeros(n, device="cuda")
            t = _time(lambda: K.onebit_compress(x, err, n), args.iters)
            report("onebit_compress", t, n * esz + 4 * n + 4 * n + n // 8)
            ranks = 8
            chunk = n // ranks
            scales = torch.rand(ranks, device="cuda") + 0.5
            t = _time(lambda: K.signs_weighted_sum(p, scales, chunk, float(ranks)), args.iters)
            report("signs_weighted_sum k=8", t, n // 8 + 4 * chunk)
            t = _time(lambda: K.unpack_scaled(p, scales, chunk, n, dtype), args.iters)
            report("unpack_scaled", t, n // 8 + n * esz)
            del x, y, q, qs, p, err
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), group_size=G, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
