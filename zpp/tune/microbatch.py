"""``zpp tune --job``'s micro-batch search: DeepSpeed's ``autotuning`` micro-batch keys, where
the job says how its micro-batch reaches it.

[Note: the micro-batch search]
DeepSpeed's autotuner tries micro-batch sizes between ``min_train_micro_batch_size_per_gpu``
(default 1) and ``max_train_micro_batch_size_per_gpu`` (default 1024) and keeps the highest
throughput. A script takes its batch from its own arguments (the Hugging Face Trainer's
``--per_device_train_batch_size``), so a size reaches it only through
``autotuning.arg_mappings``, which names the script argument of
``train_micro_batch_size_per_gpu`` (DeepSpeed's key and meaning). With that mapping, after
the mode is chosen (and raced), the winner runs as in the other trials at the job's
micro-batch doubled, doubled again, ... (``num_tuning_micro_batch_sizes`` sizes, default 3,
at most the maximum, and at most ``max_train_batch_size`` samples per optimizer step when
set), each with the argument set in the command and the key set in the config; the sizes
stop at the first run that fails (out of memory, say) or whose peak RSS is over
``--memory-gb``. The metric is DeepSpeed's ``throughput``: samples per second, ``micro-batch
x backward passes per step x data-parallel ranks / mean step``. The tuned config carries the
fastest size (and a ``train_batch_size`` that agrees with it, where the job's config had
one), and ``zpp tune`` prints the argument to run the job with. Without the mapping the
micro-batch stays the job's and the report says why. A larger micro-batch is a larger batch:
it changes what a step learns (as in DeepSpeed), which the loss race does not judge; it runs
at the job's own micro-batch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zpp.tune.metrics import mean_step_s, samples_per_micro_batch

__all__ = ["MicroBatchSearch", "from_autotuning", "search", "throughput", "with_argument"]

KEY = "train_micro_batch_size_per_gpu"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchSearch:
    """The micro-batch search of [Note: the micro-batch search], from ``autotuning``."""

    argument: str
    """The script argument that carries the micro-batch (``arg_mappings``'s value)."""
    lo: int = 1
    """``min_train_micro_batch_size_per_gpu`` (Default: 1)."""
    hi: int = 1024
    """``max_train_micro_batch_size_per_gpu`` (Default: 1024)."""
    count: int = 3
    """``num_tuning_micro_batch_sizes``: sizes tried beyond the job's (Default: 3)."""
    max_batch: int | None = None
    """``max_train_batch_size``: samples per optimizer step at most (Default: None)."""

    def sizes(self, mine: int, samples_per_micro: int) -> list[int]:
        """The sizes to try above the job's ``mine``: doublings within the bounds, where a
        micro-batch of ``m`` makes ``m * samples_per_micro`` samples per optimizer step."""
        out: list[int] = []
        m = max(mine * 2, self.lo)
        while m <= self.hi and len(out) < self.count:
            if self.max_batch is not None and m * samples_per_micro > self.max_batch:
                break
            out.append(m)
            m *= 2
        return out


def _positive(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"autotuning.{where}={value!r} must be a positive integer")
    return value


def from_autotuning(at: Mapping[str, Any]) -> MicroBatchSearch | None:
    """The search the ``autotuning`` section asks for; None without an argument mapped to
    ``train_micro_batch_size_per_gpu``. Bad values raise ``ValueError`` naming the key."""
    maps = at.get("arg_mappings")
    if maps is None:
        return None
    if not isinstance(maps, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in maps.items()):
        raise ValueError(f"autotuning.arg_mappings={maps!r} must map config keys to script arguments (strings)")
    if KEY not in maps:
        return None
    argument = maps[KEY]
    if not argument.startswith("-"):
        raise ValueError(f"autotuning.arg_mappings.{KEY}={argument!r} must be an option, e.g. "
                         "'--per_device_train_batch_size'")
    lo = _positive("min_train_micro_batch_size_per_gpu", at.get("min_train_micro_batch_size_per_gpu", 1))
    hi = _positive("max_train_micro_batch_size_per_gpu", at.get("max_train_micro_batch_size_per_gpu", 1024))
    if hi < lo:
        raise ValueError(f"autotuning.max_train_micro_batch_size_per_gpu={hi} is below "
                         f"min_train_micro_batch_size_per_gpu={lo}")
    count = _positive("num_tuning_micro_batch_sizes", at.get("num_tuning_micro_batch_sizes", 3))
    max_batch = at.get("max_train_batch_size")
    if max_batch is not None:
        max_batch = _positive("max_train_batch_size", max_batch)
    return MicroBatchSearch(argument=argument, lo=lo, hi=hi, count=count, max_batch=max_batch)


def with_argument(command: Sequence[str], option: str, value: int) -> list[str]:
    """``command`` with ``option`` set to ``value``: ``--opt V`` and ``--opt=V`` replaced in
    place (every occurrence), appended when absent."""
    out, i, found = [], 0, False
    while i < len(command):
        c = command[i]
        if c == option and i + 1 < len(command):
            out += [c, str(value)]
            i += 2
            found = True
            continue
        if c.startswith(option + "="):
            out.append(f"{option}={value}")
            found = True
        else:
            out.append(c)
        i += 1
    return out if found else [*out, option, str(value)]


def throughput(m: Mapping[str, Any], micro_batch: int) -> float:
    """Samples per second of a trial's metrics at ``micro_batch`` (DeepSpeed's metric)."""
    return micro_batch * float(m.get("micro_steps", 1.0)) * m["world"] / mean_step_s(m)


def search(run: Callable[[int], dict[str, Any]], s: MicroBatchSearch, *, mine: int, first: Mapping[str, Any],
           memory_gb: float | None) -> dict[str, Any]:
    """Run the sizes of ``s`` above the job's ``mine`` (``run(micro_batch)`` gives a trial's
    metrics; ``first`` are the chosen mode's at ``mine``) and pick the highest throughput
    (see [Note: the micro-batch search])."""
    per_micro = samples_per_micro_batch(first)
    rows = [{"micro_batch": mine, "step_s": first["step_s"], "throughput": throughput(first, mine),
             "peak_rss_bytes": first["peak_rss_bytes"]}]
    stopped = None
    for mb in s.sizes(mine, per_micro):
        m = run(mb)
        if "error" in m:
            rows.append({"micro_batch": mb, "error": m["error"]})
            stopped = f"the run at micro-batch {mb} failed ({m['error']})"
            break
        row = {"micro_batch": mb, "step_s": m["step_s"], "throughput": throughput(m, mb),
               "peak_rss_bytes": m["peak_rss_bytes"]}
        rows.append(row)
        if memory_gb is not None and m["peak_rss_bytes"] > memory_gb * 1e9:
            row["over_memory"] = True
            stopped = f"micro-batch {mb} peaked at {m['peak_rss_bytes'] / 1e9:.2f} GB, over --memory-gb={memory_gb:g}"
            break
    ok = [r for r in rows if "throughput" in r and not r.get("over_memory")]
    best = max(ok, key=lambda r: r["throughput"])
    return {"argument": s.argument, "job_micro_batch": mine, "chosen": best["micro_batch"], "tried": rows,
            "stopped": stopped,
            "why": (f"micro-batch {best['micro_batch']}: {best['throughput']:.1f} samples/s, the highest of "
                    + ", ".join(f"{r['micro_batch']}" for r in rows if "throughput" in r)
                    + (f"; stopped: {stopped}" if stopped else ""))}
