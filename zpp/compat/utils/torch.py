"""DeepSpeed's ``deepspeed.utils.torch``: torch version checks."""
from __future__ import annotations

import torch

__all__ = ["required_torch_version"]


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version``
    (either may be omitted, not both); the local label (``+cpu``) does not count."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version or max_version")
    have = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and have < str(min_version):
        return False
    return max_version is None or have <= str(max_version)
