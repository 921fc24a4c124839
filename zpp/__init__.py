"""zpp: communication-optimized collectives for PyTorch (ZeRO++ and 1-bit optimizers)."""
__version__ = "0.1.0"
__all__ = ["__version__"]
