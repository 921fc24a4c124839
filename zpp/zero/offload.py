"""ZeRO-Offload: optimizer states and parameter shards in host memory on a CUDA job.

[Note: offload]
``zero_optimization.offload_optimizer.device: "cpu"`` (stages 1-3): each unit's fp32 master
shard, its reduced gradient and the optimizer state live in host memory, and the optimizer
steps there (torch's CPU Adam); after each reduction the gradient shard is copied to the
host (asynchronously, into page-locked memory when ``pin_memory``, on a copy stream, so it
overlaps the rest of the backward), and after the step the updated master is copied back
into the device shard. Device memory per rank drops from ``16 Psi / N`` to the parameter
shard (``4 Psi / N`` in fp32, ``2 Psi / N`` in bf16) plus gathered units.

``offload_optimizer.device: "nvme"`` places the masters and the step as "cpu" does, and
keeps the optimizer's per-element state in a swap file between steps (see [Note: NVMe
swap] in :mod:`zpp.zero.nvme`).

``zero_optimization.offload_param.device: "cpu"`` (stage 3): the parameter shards live in
host memory too; each gather first copies this rank's shard to the device.

On a CPU job the states and shards are in host memory already: both settings are accepted
and logged once, and nothing moves (:attr:`Offload.active` is False).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from zpp.zero.config import TrainConfig

log = logging.getLogger("zpp.zero")


@dataclasses.dataclass(frozen=True, slots=True)
class Offload:
    """What a unit keeps in host memory; see [Note: offload]."""

    optimizer: bool = False
    """Masters, reduced gradients and optimizer state on the host."""
    params: bool = False
    """Parameter shards on the host (stage 3)."""
    pin_memory: bool = False
    """Page-locked host buffers (faster, overlappable copies)."""

    @property
    def active(self) -> bool:
        return self.optimizer or self.params

    @classmethod
    def from_config(cls, config: TrainConfig, device: torch.device) -> Offload:
        """The offload of ``config`` for parameters on ``device`` (nothing on a CPU job)."""
        zero = config.zero
        want_opt = zero.offload_optimizer.device in ("cpu", "nvme")  # nvme: the host steps, see zpp.zero.nvme
        want_params = zero.offload_param.device == "cpu" and zero.stage == 3
        if not (want_opt or want_params):
            return cls()
        if device.type == "cpu":
            if zero.offload_optimizer.device == "nvme" and not want_params:
                return cls()  # the states are in host memory between the swap file and the step
            log.info("zpp: offload_optimizer/offload_param device 'cpu' on a CPU job: the optimizer states and "
                     "parameter shards are in host memory already; nothing moves")
            return cls()
        pin = zero.offload_optimizer.pin_memory or zero.offload_param.pin_memory
        return cls(optimizer=want_opt or want_params, params=want_params, pin_memory=pin)

    def host(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host copy of ``t`` (page-locked when ``pin_memory``)."""
        out = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=self.pin_memory)
        out.copy_(t)
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a device gradient shard) copied into a new host buffer, asynchronously:
        :func:`settle` before reading it."""
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        if t.device.type == "cuda":
            stream = _copy_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                out.copy_(t, non_blocking=self.pin_memory)
            t.record_stream(stream)  # t stays allocated until the copy is done
        else:
            out.copy_(t)
        return out

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (a host shard) on ``device`` (ordered on the current stream)."""
        return t.to(device, non_blocking=self.pin_memory)


_STREAMS: dict[torch.device, object] = {}


def _copy_stream(device: torch.device):
    s = _STREAMS.get(device)
    if s is None:
        s = _STREAMS[device] = torch.cuda.Stream(device)
    return s


def settle() -> None:
    """Wait for every host copy started by :meth:`Offload.to_host`."""
    for s in _STREAMS.values():
        s.synchronize()
