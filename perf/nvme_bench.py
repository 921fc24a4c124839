"""The NVMe tier against memory, and against the disk's own sequential bandwidth.

    python perf/nvme_bench.py --json perf/results/nvme_bench.json          # the 25M GPT, 2 ranks
    /work/dsenv/bin/python perf/nvme_bench.py --world 1 --variants zero3,zero3-nvme,deepspeed3,deepspeed3-nvme
                                                  # + DeepSpeed ZeRO-Infinity (its async_io op needs libaio-dev)

1. The disk: ``dd`` writes then reads ``--dd-mib`` MiB under ``--nvme-path`` with direct I/O
   (``oflag=direct conv=fsync``, ``iflag=direct``, 1 MiB blocks): the sequential bandwidth.
2. The training step: perf/train_bench.py, one process per variant (so peak RSS is the
   variant's own), stages 2 and 3 in memory and with ``offload_optimizer.device: "nvme"``,
   on the same GPT, data and AdamW.
3. Per NVMe row: the swap's bytes per step, the seconds with a transfer in flight
   (``busy_s``), the swap's bandwidth while busy (bytes / busy_s) against dd's, and the
   seconds the step waited on it; ``state_B`` (zpp's model-state bytes: the optimizer's share
   is the host buffers) against the in-memory row.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runinfo  # noqa: E402

_RATE = re.compile(r"(\d+) bytes .* copied, ([\d.]+) s")


def dd(args: list[str]) -> float:
    """Bytes per second of one ``dd`` run (from its summary line)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = _RATE.search(out)
    if m is None:
        raise RuntimeError(f"dd: no summary in {out!r}")
    return int(m.group(1)) / float(m.group(2))


def disk(path: Path, mib: int) -> dict[str, float]:
    path.mkdir(parents=True, exist_ok=True)
    f = path / "dd.bin"
    try:
        write = dd(["if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
        read = dd([f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"])
    finally:
        f.unlink(missing_ok=True)
    return {"write_Bps": write, "read_Bps": read, "mib": mib}


def train(variant: str, args, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(HERE / "train_bench.py"), "--world", str(args.world), "--variants", variant,
               "--nvme-path", str(args.nvme_path), "--json", str(out), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            return {"variant": variant, "error": proc.stderr[-2000:]}
        return json.loads(out.read_text())["rows"][0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "zpp-nvme-bench")
    p.add_argument("--dd-mib", type=int, default=1024)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variants", default="zero2,zero2-nvme,zero3,zero3-nvme")
    p.add_argument("--json", default=None)
    args, extra = p.parse_known_args(argv)
    # the 25M benchmark GPT; train_bench options given here come after, so they win
    extra = ["--n-layer", "8", "--n-embd", "512", "--n-head", "8", "--block", "128", "--batch", "4", "--steps", "4",
             "--warmup", "1", "--ranks-per-node", str(args.world), *extra]
    d = disk(args.nvme_path, args.dd_mib)
    print(f"# dd on {args.nvme_path}: write {d['write_Bps'] / 1e6:.0f} MB/s, read {d['read_Bps'] / 1e6:.0f} MB/s "
          f"(direct I/O, 1 MiB blocks, {args.dd_mib} MiB)")
    rows = [train(v, args, extra) for v in args.variants.split(",")]
    print(f"{'variant':<16}{'step_s':>8}{'opt_s':>7}{'state_MB':>10}{'peak_MiB':>9}{'swap_MB/step':>13}"
          f"{'busy_s':>8}{'swap_MB/s':>10}{'of dd':>7}{'wait_s':>8}{'loss':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<16} failed: {r['error'][-300:]}")
            continue
        nv = r.get("nvme")
        state = r.get("model_state_bytes")  # None for DeepSpeed's rows (zpp's counter)
        line = (f"{r['variant']:<16}{r['step_s']:>8.3f}{r['opt_s']:>7.3f}"
                f"{'-' if state is None else format(state / 1e6, '.1f'):>10}{r['peak_rss_mib']:>9.0f}")
        if nv:
            moved = nv["read_bytes_per_step"] + nv["written_bytes_per_step"]
            rate = moved / nv["busy_s_per_step"] if nv["busy_s_per_step"] > 0 else float("nan")
            # the swap reads and writes at once: compare with the mean of dd's two directions
            ref = (d["write_Bps"] + d["read_Bps"]) / 2
            nv["bandwidth_Bps"], nv["of_dd"] = rate, rate / ref
            line += (f"{moved / 1e6:>13.1f}{nv['busy_s_per_step']:>8.3f}{rate / 1e6:>10.0f}{rate / ref:>7.2f}"
                     f"{nv['wait_s_per_step']:>8.3f}")
        else:
            line += f"{'-':>13}{'-':>8}{'-':>10}{'-':>7}{'-':>8}"
        print(line + f"{r['loss']:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**runinfo.provenance(), "disk": d, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
