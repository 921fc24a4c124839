"""zpp: communication-optimized collectives for PyTorch (ZeRO++ and 1-bit optimizers).

>>> engine, optimizer, _, lr_scheduler = zpp.initialize(model=model, config="ds_config.json")
>>> zpp.init_distributed()          # as deepspeed.init_distributed; zpp.comm as deepspeed.comm
"""
__version__ = "0.1.0"
__all__ = ["__version__", "comm", "init_distributed", "initialize"]


def __getattr__(name: str):
    # Lazy: `zpp --help` and argument errors must not pay for importing torch.
    if name == "initialize":
        from zpp.zero import initialize

        return initialize
    if name == "init_distributed":
        from zpp.comm.dist import init_distributed

        return init_distributed
    if name == "comm":  # `import zpp as deepspeed; deepspeed.comm.get_rank()`
        import importlib

        return importlib.import_module("zpp.comm")
    raise AttributeError(f"module 'zpp' has no attribute {name!r}")
