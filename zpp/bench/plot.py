"""``--plot FILE.png``: bus bandwidth against size, one panel per op, one line per variant.
Needs matplotlib (the ``plot`` extra: ``pip install 'zpp[plot]'``)."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zpp.bench.harness import Row

__all__ = ["MISSING", "available", "plot_rows"]

MISSING = "--plot needs matplotlib, which is not installed: pip install 'zpp[plot]' (or matplotlib)"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_rows(rows: list[Row], path: str, meta: dict) -> None:
    """Write the figure to ``path`` (format from its extension)."""
    if not available():
        raise RuntimeError(MISSING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.6), squeeze=False, sharey=True)
    for ax, op in zip(axes[0], ops):
        for compress in dict.fromkeys(r.compress for r in rows if r.op == op):
            mine = [r for r in rows if r.op == op and r.compress == compress]
            ax.plot([r.size for r in mine], [r.busbw for r in mine], marker="o", ms=3, label=compress)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("size (B)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("busbw (GB/s)")
    fig.suptitle(f"zpp bench: {meta['world_size']} ranks = {meta['nodes']} x {meta['ranks_per_node']}, "
                 f"{meta['backend']}, {meta['dtype']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
