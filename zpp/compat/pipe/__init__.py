"""DeepSpeed's ``deepspeed.pipe``: importable, refused at construction.

zpp is data-parallel; pipeline parallelism is torch's ``torch.distributed.pipelining``.
Scripts and shared test code import ``PipelineModule`` and ``LayerSpec`` to define classes
they may never build, so the import works and building one raises ``NotImplementedError``
saying so (see :func:`zpp.unsupported.refused_class`).
"""
import torch

from zpp.compat.unsupported import PIPE, refused_class

PipelineModule = refused_class("PipelineModule", __name__, PIPE, torch.nn.Module)
LayerSpec = refused_class("LayerSpec", __name__, PIPE)
TiedLayerSpec = refused_class("TiedLayerSpec", __name__, PIPE, LayerSpec)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
