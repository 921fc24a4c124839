"""A stand-in for the part of cupy that zpp/quant/cuda.py uses, running the kernels in the host
emulation library that run.py builds (verification only; set ZPP_EMU_LIB to that library)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import types

import numpy as np

_lib = ctypes.CDLL(os.environ["ZPP_EMU_LIB"])
_lib.emu_has.argtypes = [ctypes.c_char_p]
_lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
_CODES = {np.uint64: "P", np.int64: "q", np.int32: "i", np.uint32: "I", np.float32: "f"}
launches: list[tuple[str, int, int]] = []  # (name, grid, block) of every launch, for the curious


class _Function:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, grid, block, args, stream=None, shared_mem=0):
        if not (isinstance(grid, tuple) and isinstance(block, tuple) and len(grid) == len(block) == 1):
            raise TypeError(f"{self.name}: grid {grid!r} and block {block!r} must be 1-tuples")
        if stream is None:
            raise TypeError(f"{self.name}: launched without a stream")
        try:
            codes = "".join(_CODES[type(a)] for a in args)
        except KeyError as exc:
            raise TypeError(f"{self.name}: an argument of type {exc} is not a sized numpy scalar") from None
        boxes = [np.array(a) for a in args]
        ptrs = (ctypes.c_void_p * len(boxes))(*[b.ctypes.data for b in boxes])
        launches.append((self.name, grid[0], block[0]))
        rc = _lib.emu_launch(self.name.encode(), grid[0], block[0], ptrs, codes.encode())
        if rc:
            raise RuntimeError(f"emulated launch of {self.name} failed ({rc}); see stderr")


class RawModule:
    def __init__(self, *, code: str, options=(), name_expressions=()):
        if not isinstance(options, tuple):
            raise TypeError("options must be a tuple")
        missing = [n for n in name_expressions if not _lib.emu_has(n.encode())]
        if missing:
            raise RuntimeError(f"kernels not in the emulation table (perf/cuda_emulate/emu.cpp): {missing}")
        self._names = tuple(name_expressions)

    def compile(self):
        return None

    def get_function(self, name: str) -> _Function:
        if name not in self._names:
            raise KeyError(name)
        return _Function(name)


class _Stream:
    def __init__(self, handle: int):
        self.handle = handle

    @classmethod
    def from_external(cls, obj):
        return cls(obj.__cuda_stream__()[1])


_Stream.null = _Stream(0)


@contextlib.contextmanager
def _device(index):
    yield


cuda = types.SimpleNamespace(Device=_device, Stream=_Stream)
__version__ = "0+emulated"
