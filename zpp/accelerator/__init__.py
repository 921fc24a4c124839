"""DeepSpeed's accelerator interface (``deepspeed.accelerator``) for CPU and CUDA.

    from zpp.accelerator import get_accelerator      # or: from zpp import get_accelerator
    device = get_accelerator().device_name(local_rank)  # "cuda:0" / "cpu"
"""
from zpp.accelerator.real_accelerator import (
    Accelerator, CpuAccelerator, CudaAccelerator, get_accelerator, set_accelerator,
)

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator"]
