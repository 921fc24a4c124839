"""Rank 0's output: the nccl-tests style table on stdout, and the JSON file.

The table: a ``#`` header block, then per op a ``# <op>`` line, the ``#`` column header,
one row per size and variant, and ``# Avg bus bandwidth`` per variant; at the end
``# Out of bounds values``. Every line that is not a row starts with ``#``, so
``grep -v '^#'`` leaves the rows, whose whitespace-separated columns are ``COLUMNS``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import IO

from zpp.bench.harness import Row

__all__ = ["COLUMNS", "Table", "loopback_note", "write_json"]

COLUMNS = ("size(B)", "count", "type", "variant", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
           "#wrong", "inter(B)", "ratio", "maxrelerr")
_WIDTHS = (12, 11, 9, 7, 11, 11, 11, 7, 12, 7, 9)


def _fmt_row(cells) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, _WIDTHS))


def _num(x: float | None, spec: str) -> str:
    if x is None:
        return "N/A"
    return format(x, spec) if math.isfinite(x) else str(x)


class Table:
    """Prints the table to ``out`` as the sweep goes (flushing after every line)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.rows: list[Row] = []
        self._op_rows: list[Row] = []

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def header(self, meta: dict) -> None:
        ops = list(dict.fromkeys(v["op"] for v in meta["variants"]))
        variants = " ".join(f"{v['op']}/{v['compress']}" for v in meta["variants"])
        for text in (
            f"zpp bench {meta['zpp']}  torch {meta['torch']}  {meta['date']}  host {meta['host']}",
            f"world {meta['world_size']} ranks = {meta['nodes']} nodes x {meta['ranks_per_node']} ranks per "
            f"node  backend {meta['backend']} ({meta['transport']})  dtype {meta['dtype']}",
            f"warmup {meta['warmup']}  iters {meta['iters']} (fewer above "
            f"{meta['full_iters_up_to_bytes'] >> 20} MiB)  quant group size {meta['group_size']}  "
            f"quant kernels {meta['quant_kernels']}  seed {meta['seed']}",
            f"ops {' '.join(ops)}; variants {variants}",
            "time: slowest rank's mean per call; busbw = algbw x (2(n-1)/n all_reduce, (n-1)/n others)",
            "inter(B): bytes sent to other nodes per call (largest rank); ratio: bytes the plain "
            "collective sends / bytes this variant sends, intra- and inter-node together",
            "#wrong: elements outside the variant's error bound, all ranks (1bit: non-finite or "
            "not rank 0's); maxrelerr: max|y-exact|/max|exact|",
        ):
            self._line(f"# {text}")
        if meta["nodes"] == 1:
            self._line("# one node: nothing crosses a node (inter(B) 0), so ratio compares the bytes sent inside "
                       "the node; --ranks-per-node or ZPP_RANKS_PER_NODE sets the emulated nodes")

    def op(self, op: str) -> None:
        self._close_op()
        self._line("#")
        self._line(f"# {op}")
        self._line("#" + _fmt_row(COLUMNS)[1:])

    def row(self, r: Row) -> None:
        self.rows.append(r)
        self._op_rows.append(r)
        self._line(_fmt_row((
            r.size, r.count, r.dtype, r.compress, f"{r.time_us:.1f}", _num(r.algbw, ".3f"),
            _num(r.busbw, ".3f"), r.wrong, r.inter_bytes, _num(r.ratio, ".2f"),
            _num(r.maxrelerr, ".2e"),
        )))

    def _close_op(self) -> None:
        """nccl-tests' average line, per variant of the op just finished."""
        seen: dict[str, list[float]] = {}
        for r in self._op_rows:
            seen.setdefault(r.compress, []).append(r.busbw)
        for compress, values in seen.items():
            avg = sum(values) / len(values)
            self._line(f"# Avg bus bandwidth    : {_num(avg, '.4f')}  ({self._op_rows[0].op} {compress})")
        self._op_rows = []

    def footer(self) -> int:
        """The last line; returns the total of ``#wrong``."""
        self._close_op()
        wrong = sum(r.wrong for r in self.rows)
        self._line("#")
        self._line(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        return wrong


def write_json(path: str, meta: dict, rows: list[Row]) -> None:
    """``{"meta": {...}, "rows": [{...}, ...]}``; non-finite numbers become null."""
    def clean(x):
        return None if isinstance(x, float) and not math.isfinite(x) else x

    doc = {
        "meta": meta,
        "columns": list(COLUMNS),
        "rows": [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in rows],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def loopback_note(rows: list[Row], on_cluster: bool) -> str | None:
    """Why compression lost, where it did on one machine: the nodes share loopback (tens of
    Gbit/s), so quantizing costs more time than the bytes it saves. None under ``zpp cluster
    run`` (there the table is the answer) or when no compressed variant was slower."""
    if on_cluster:
        return None
    plain = {(r.op, r.size): r.time_us for r in rows if r.compress == "none"}
    slower = sorted({f"{r.op}/{r.compress}" for r in rows
                     if r.compress not in ("none", "2hop") and r.time_us > plain.get((r.op, r.size), math.inf)})
    if not slower:
        return None
    return (f"note: {', '.join(slower)} slower than plain here: these emulated nodes share one machine's "
            "loopback, where quantizing costs more time than the bytes it saves. Compression pays where "
            "the link is slow; see it on this machine (root): `zpp cluster up --nodes 2 --rate 100mbit && "
            "zpp cluster run --nodes 2 --ranks-per-node 2 -- zpp bench; zpp cluster down`")
