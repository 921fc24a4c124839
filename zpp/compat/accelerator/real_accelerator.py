"""The accelerator objects (DeepSpeed's ``DeepSpeedAccelerator`` interface) and
:func:`get_accelerator`, which picks one per process.

Choice: ``ZPP_ACCELERATOR``, else ``DS_ACCELERATOR`` ("cpu" or "cuda"), else "cuda" when
``torch.cuda.is_available()``, else "cpu". Method names, signatures and return values are
DeepSpeed 0.19's (``accelerator/cpu_accelerator.py``, ``cuda_accelerator.py``). Where a
DeepSpeed behaviour is a bug, zpp differs and the method says so: on CPU ``current_device()``
is an int (DeepSpeed returns the ``LOCAL_RANK`` string), ``device()`` is
``torch.device("cpu")`` (DeepSpeed returns None), ``is_fp16_supported()`` is a bool
(DeepSpeed may return None), and the peak memory is the kernel's (``VmHWM``), not the
largest value seen by earlier calls.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Any

import torch

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator"]

#: Accelerator names DeepSpeed knows; zpp has "cpu" and "cuda".
DEEPSPEED_ACCELERATORS = ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa")


class Accelerator:
    """What both devices share; :class:`CpuAccelerator` and :class:`CudaAccelerator` fill in
    the rest. DeepSpeed's ``DeepSpeedAccelerator`` methods, by its names."""

    _name = "abstract"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"<zpp {type(self).__name__} {self._name!r}>"

    # ---- what kind of device
    def is_synchronized_device(self) -> bool:
        """Whether work completes when the call returns (CPU) rather than later (CUDA)."""
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device: "gloo" (CPU) or "nccl" (CUDA)."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    # ---- random numbers
    def random(self):
        """``torch.random``."""
        return torch.random

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # ---- dtypes
    def is_bf16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def is_fp16_supported(self) -> bool:  # pragma: no cover - each device overrides it
        raise NotImplementedError

    # ---- compile backend
    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend!r} is not a torch.compile backend on {self._name}; supported: {supported}")
        self._compile_backend = backend

    # ---- environment of the launcher
    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    # ---- DeepSpeed's op builders: what zpp has of each op (zpp.ops.op_builder)
    def op_builder_dir(self) -> str:
        return "zpp.ops.op_builder"

    def get_op_builder(self, class_name: str) -> type:
        """The builder class ``class_name`` (``"FusedAdamBuilder"``...) of
        :mod:`zpp.ops.op_builder`; ``ValueError`` for a name DeepSpeed does not have."""
        from zpp.compat.ops import op_builder

        builder = getattr(op_builder, class_name, None)
        if not (isinstance(builder, type) and issubclass(builder, op_builder.OpBuilder)):
            raise ValueError(f"get_op_builder: {class_name!r} is not one of DeepSpeed's op builders "
                             f"({sorted(b.__name__ for b in op_builder.ALL_OPS.values())})")
        return builder

    def create_op_builder(self, class_name: str):
        """An instance of :meth:`get_op_builder`'s class."""
        return self.get_op_builder(class_name)()

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension


# ---------------------------------------------------------------------- CPU
def _proc_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


class CpuAccelerator(Accelerator):
    """The host as the device: gloo, no streams, memory is the process's resident set."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._peak_seen = 0  # where the kernel's peak (VmHWM) cannot be read

    # ---- devices
    def device_name(self, device_index: int | None = None) -> str:
        """Always "cpu" (an index names no other device)."""
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        """``torch.device("cpu")`` (DeepSpeed returns None, which no tensor call accepts)."""
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        """The local rank, as an int (``LOCAL_RANK``; 0 outside a launcher). DeepSpeed
        returns the environment string here, which breaks arithmetic on it."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """The ranks of this node as the launcher tells them (``LOCAL_WORLD_SIZE``, else
        ``LOCAL_SIZE``), else 1: one CPU "device" per local rank."""
        for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            value = os.environ.get(var, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    # ---- random numbers
    def set_rng_state(self, new_state, device_index=None):
        return torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def manual_seed(self, seed: int):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.manual_seed(seed)

    def default_generator(self, device_index: int | None = None):
        return torch.default_generator

    # ---- streams and events: none on the host
    @property
    def Stream(self):
        return None

    def stream(self, stream):
        """A context that does nothing (the host has one stream)."""
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    @property
    def Event(self):
        return None

    # ---- memory: the process's resident set
    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index=None) -> int:
        """Resident set size of this process, in bytes."""
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._peak_seen = max(self._peak_seen, rss)
        return rss

    def max_memory_allocated(self, device_index=None) -> int:
        """Peak resident set size since the process started or the last
        :meth:`reset_peak_memory_stats`, from the kernel (``VmHWM``)."""
        now = self.memory_allocated()
        hwm = _proc_kb("VmHWM")
        return max(hwm, now) if hwm is not None else self._peak_seen

    def reset_peak_memory_stats(self, device_index=None) -> None:
        """Reset the peak to the current resident set (``/proc/self/clear_refs``)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self._peak_seen = 0
        self._peak_seen = self.memory_allocated()

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats
    memory_cached = memory_allocated
    memory_reserved = memory_allocated
    max_memory_cached = max_memory_allocated
    max_memory_reserved = max_memory_allocated

    def memory_stats(self, device_index=None) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index=None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        try:
            with open("/proc/meminfo") as f:
                return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
        except (OSError, AttributeError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ---- dtypes
    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels on this CPU (DeepSpeed's test), as a bool."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:
            return False

    # ---- misc
    def range_push(self, msg, domain=None, category=None):
        return None

    def range_pop(self, domain=None):
        return None

    def lazy_call(self, callback):
        return callback()

    def amp(self):
        """``torch.cpu.amp``."""
        return torch.cpu.amp

    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph):
        return None

    # DeepSpeed's CPU accelerator hands out torch's legacy constructors (FloatTensor(3) is
    # three elements, FloatTensor([3]) one); its CUDA one hands out torch.tensor partials.
    @property
    def BFloat16Tensor(self):
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self):
        return torch.ByteTensor

    @property
    def DoubleTensor(self):
        return torch.DoubleTensor

    @property
    def FloatTensor(self):
        return torch.FloatTensor

    @property
    def HalfTensor(self):
        return torch.HalfTensor

    @property
    def IntTensor(self):
        return torch.IntTensor

    @property
    def LongTensor(self):
        return torch.LongTensor

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """The tensor itself: page-locking host memory serves copies to a device, and there
        is none."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"


# ---------------------------------------------------------------------- CUDA
class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through ``torch.cuda``; NCCL."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index=None):
        return torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_triton_supported(self) -> bool:
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    # ---- random numbers
    def set_rng_state(self, new_state, device_index=None):
        if device_index is None:
            return torch.cuda.set_rng_state(new_state)
        return torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        if device_index is None:
            return torch.cuda.get_rng_state()
        return torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index]

    # ---- streams and events
    @property
    def Stream(self):
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):
        return torch.cuda.Event

    # ---- memory
    def empty_cache(self) -> None:
        return torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None):
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None):
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None) -> int:
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    # ---- dtypes
    def is_bf16_supported(self) -> bool:
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Compute capability 7.0 and up (6.x with ``DS_ALLOW_DEPRECATED_FP16=1``), as
        DeepSpeed decides."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    # ---- misc
    def range_push(self, msg, domain=None, category=None):
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback)

    def amp(self):
        """``torch.cuda.amp``."""
        return torch.cuda.amp

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph):
        graph.replay()

    @property
    def BFloat16Tensor(self):
        return functools.partial(torch.tensor, dtype=torch.bfloat16, device="cuda")

    @property
    def ByteTensor(self):
        return functools.partial(torch.tensor, dtype=torch.uint8, device="cuda")

    @property
    def DoubleTensor(self):
        return functools.partial(torch.tensor, dtype=torch.float64, device="cuda")

    @property
    def FloatTensor(self):
        return functools.partial(torch.tensor, dtype=torch.float32, device="cuda")

    @property
    def HalfTensor(self):
        return functools.partial(torch.tensor, dtype=torch.float16, device="cuda")

    @property
    def IntTensor(self):
        return functools.partial(torch.tensor, dtype=torch.int32, device="cuda")

    @property
    def LongTensor(self):
        return functools.partial(torch.tensor, dtype=torch.int64, device="cuda")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def export_envs(self) -> list[str]:
        return ["NCCL"]


# ---------------------------------------------------------------------- choice
_ACCELERATORS = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}
_current: Accelerator | None = None


def _choose(env: Any = os.environ) -> str:
    for var in ("ZPP_ACCELERATOR", "DS_ACCELERATOR"):
        name = env.get(var)
        if name:
            if name not in _ACCELERATORS:
                other = " (a DeepSpeed accelerator zpp does not have)" if name in DEEPSPEED_ACCELERATORS else ""
                raise ValueError(f"{var}={name!r}{other}: zpp's accelerators are {sorted(_ACCELERATORS)}")
            if name == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"{var}='cuda' but torch.cuda.is_available() is False on this machine")
            return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """This process's accelerator, chosen on the first call (see the module docstring) and
    the same object afterwards."""
    global _current
    if _current is None:
        _current = _ACCELERATORS[_choose()]()
    return _current


def set_accelerator(accel_obj: Accelerator | None) -> None:
    """Use ``accel_obj`` from now on (None: choose again at the next
    :func:`get_accelerator`)."""
    global _current
    if accel_obj is not None and not isinstance(accel_obj, Accelerator):
        raise TypeError(f"set_accelerator: {accel_obj!r} is not a zpp.accelerator.Accelerator")
    _current = accel_obj
