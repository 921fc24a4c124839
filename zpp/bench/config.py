"""What one ``zpp bench`` sweep measures: the typed, validated configuration and the size
syntax of ``--sizes``.

Sizes are bytes with an optional binary suffix (``K`` = 1024, ``M``, ``G``; a trailing ``B``
or ``iB`` is accepted): ``64K``, ``1M``, ``4096``. ``--sizes`` takes one size, a comma list
(``1K,1M``), or a range ``MIN:MAX[:FACTOR]`` stepping by ``FACTOR`` (Default: 2), MAX
included, like nccl-tests' ``-b MIN -e MAX -f FACTOR``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Literal

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
COMPRESSIONS = ("none", "2hop", "int8", "int4", "1bit")
BACKENDS = ("torch", "mpi")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_SIZES = "1K:4M"
#: The compressions each op has (:mod:`zpp.bench.variants` implements exactly these).
VARIANT_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather": ("none", "int8", "int4"),
    # 2hop: qgZ's two hops uncompressed (the baseline that separates hierarchy from quantization)
    "reduce_scatter": ("none", "2hop", "int8", "int4"),
    # int8/int4: quantized reduce-scatter + quantized all-gather (the zpp.outer all-reduce)
    "all_reduce": ("none", "int8", "int4", "1bit"),
    "all_to_all": ("none",),
}

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(I?B)?\s*$", re.IGNORECASE)


def applicable(ops: tuple[str, ...], compress: tuple[str, ...]) -> tuple[list[tuple[str, str]], list[str]]:
    """The (op, compression) pairs of ``ops x compress`` that exist, in op then compression
    order, and the ``"op/compression"`` pairs that do not."""
    chosen, skipped = [], []
    for op in ops:
        for c in compress:
            if c in VARIANT_NAMES.get(op, ()):
                chosen.append((op, c))
            else:
                skipped.append(f"{op}/{c}")
    return chosen, skipped


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536. Raises ValueError naming the text."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"size {text!r} is not a byte count like 4096, 64K, 1M or 2G")
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1K:8K"`` -> (1024, 2048, 4096, 8192); ``"1K,1M"`` -> (1024, 1048576)."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"sizes {text!r}: expected MIN:MAX or MIN:MAX:FACTOR")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = 2
        if len(parts) == 3:
            if not parts[2].strip().isdigit() or int(parts[2]) < 2:
                raise ValueError(f"sizes {text!r}: FACTOR {parts[2]!r} must be an integer >= 2")
            factor = int(parts[2])
        if lo > hi:
            raise ValueError(f"sizes {text!r}: MIN ({lo} B) is larger than MAX ({hi} B)")
        sizes = [lo]
        while sizes[-1] * factor <= hi:
            sizes.append(sizes[-1] * factor)
        return tuple(sizes)
    sizes = tuple(parse_size(p) for p in text.split(","))
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"sizes {text!r} repeat a size")
    return sizes


def format_size(nbytes: int) -> str:
    """65536 -> ``"64K"``; sizes that are not whole units stay in bytes."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BenchConfig:
    """One sweep: every selected (op, compression) variant at every size."""

    ops: tuple[str, ...] = OPS
    """Collectives to run, from ``OPS``. (Default: all four.)"""
    compress: tuple[str, ...] = COMPRESSIONS
    """Compressions to run, from ``COMPRESSIONS``; those that do not apply to an op are
    skipped (see :func:`zpp.bench.variants.select`). (Default: all.)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Element type of the data being communicated. (Default: float32.)"""
    sizes: tuple[int, ...] = parse_sizes(DEFAULT_SIZES)
    """Logical bytes per call (the output of an all-gather, the input of the others).
    (Default: 1K to 4M by powers of two.)"""
    warmup: int = 5
    """Untimed calls before the timed ones, at sizes up to 1 MiB. (Default: 5.)"""
    iters: int = 20
    """Timed calls at sizes up to 1 MiB; above it both counts shrink in proportion to the
    size, to at least 1 (see :func:`zpp.bench.harness.iterations`). (Default: 20.)"""
    group_size: int = 2048
    """Elements per quantization group (one fp32 scale each) for int8/int4. (Default: 2048.)"""
    seed: int = 0
    """Seed of the generated inputs. (Default: 0.)"""

    def __post_init__(self) -> None:
        for name, allowed in (("ops", OPS), ("compress", COMPRESSIONS)):
            values = getattr(self, name)
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                raise ValueError(f"{name}={values!r}: {bad or 'empty'} not in {allowed}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if not self.sizes or any(not isinstance(s, int) or s <= 0 for s in self.sizes):
            raise ValueError(f"sizes={self.sizes!r} must be positive byte counts")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if self.iters < 1:
            raise ValueError(f"iters={self.iters} must be >= 1")
        if self.group_size <= 0 or self.group_size % 2:
            raise ValueError(f"group_size={self.group_size} must be a positive even integer")
