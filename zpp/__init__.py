"""zpp: communication-optimized collectives for PyTorch (ZeRO++ and 1-bit optimizers).

>>> engine, optimizer, _, lr_scheduler = zpp.initialize(model=model, config="ds_config.json")
"""
__version__ = "0.1.0"
__all__ = ["__version__", "initialize"]


def __getattr__(name: str):
    # Lazy: `zpp --help` and argument errors must not pay for importing torch.
    if name == "initialize":
        from zpp.zero import initialize

        return initialize
    raise AttributeError(f"module 'zpp' has no attribute {name!r}")
