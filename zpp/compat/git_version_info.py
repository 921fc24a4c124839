"""DeepSpeed's ``deepspeed.git_version_info``: what was built and with which torch.

zpp builds no ops ahead of time (its kernels compile at first use), so ``installed_ops``
says False for each of DeepSpeed's op names; ``torch_info`` describes the torch zpp runs
on (DeepSpeed records the torch it was built against, "0.0" where it was built without).
"""
from __future__ import annotations

import torch

import zpp
from zpp.compat.ops.op_builder import ALL_OPS

version = zpp.__version__
git_hash = None
git_branch = None
installed_ops = dict.fromkeys(ALL_OPS, False)
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _version(v: str | None) -> str:
    return ".".join(v.split(".")[:2]) if v else "0.0"


torch_info = {
    "version": _version(torch.__version__.split("+")[0]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _version(torch.version.cuda),
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0",
    "hip_version": _version(getattr(torch.version, "hip", None)),
}

__all__ = ["accelerator_name", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
