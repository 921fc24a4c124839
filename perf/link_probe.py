"""Time one all-gather over the world and one inside the node (zpp.zero.trial's link probe),
for the cost model's links; rank 0 writes JSON.

    zpp cluster run --ranks-per-node 2 -- python perf/link_probe.py --json probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zpp.comm import get_transport  # noqa: E402
from zpp.comm.topology import topology_of  # noqa: E402
from zpp.zero.trial import LINK_PROBE_BYTES, probe_all_gather  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--bytes", type=int, default=LINK_PROBE_BYTES, help="per rank (default: 1 MiB)")
    ap.add_argument("--repeat", type=int, default=3, help="probes; the median is kept (default: 3)")
    args = ap.parse_args(argv)
    t = get_transport()
    topo = topology_of(t)
    world = sorted(probe_all_gather(t, args.bytes) for _ in range(args.repeat))[args.repeat // 2]
    intra = sorted(probe_all_gather(topo.intra, args.bytes) for _ in range(args.repeat))[args.repeat // 2] \
        if topo.ranks_per_node > 1 else 0.0
    if t.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"world": t.world_size, "nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node,
                       "probe_bytes": args.bytes, "probe_world_s": world, "probe_intra_s": intra}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
