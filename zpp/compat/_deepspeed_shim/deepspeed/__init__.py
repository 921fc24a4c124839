"""``deepspeed``, standing for zpp: on ``sys.path`` only through ``zpp run`` (or
``zpp.as_deepspeed.install()``); see :mod:`zpp.as_deepspeed`."""
from zpp.compat.as_deepspeed import become_deepspeed

become_deepspeed(__name__)
