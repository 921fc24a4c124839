"""DeepSpeed's accelerator interface (``deepspeed.accelerator``) for CPU and CUDA.

    from zpp.compat.accelerator import get_accelerator      # or: from zpp import get_accelerator
    device = get_accelerator().device_name(local_rank)  # "cuda:0" / "cpu"
"""
from zpp.compat.accelerator.real_accelerator import (
    Accelerator, CpuAccelerator, CudaAccelerator, get_accelerator, set_accelerator,
)

#: The accelerators zpp runs on (DeepSpeed's list is longer: xpu, npu, mps, hpu, ...).
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]


def is_current_accelerator_supported() -> bool:
    """Whether :func:`get_accelerator` names an accelerator zpp runs on (always, for zpp's
    own: CPU and CUDA)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


__all__ = ["SUPPORTED_ACCELERATOR_LIST", "Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]
