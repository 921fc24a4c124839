"""Import a perf/ script as a module (perf/ on sys.path while it loads its siblings)."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

PERF = Path(__file__).resolve().parent.parent / "perf"


@contextmanager
def perf_module(name: str) -> Iterator[ModuleType]:
    """``perf/<name>.py`` loaded as a module, for the length of the ``with``."""
    sys.path.insert(0, str(PERF))
    try:
        spec = importlib.util.spec_from_file_location(name, PERF / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(PERF))
