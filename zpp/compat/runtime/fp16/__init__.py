"""DeepSpeed's ``deepspeed.runtime.fp16``: its optimizer wrapper classes import (for
``isinstance`` checks) and refuse construction; fp16 in zpp is the config's ``"fp16"``
section. The 1-bit optimizers (``runtime.fp16.onebit``) are :mod:`zpp.optim`."""
