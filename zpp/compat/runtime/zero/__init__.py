"""DeepSpeed's ``deepspeed.runtime.zero``: :mod:`~zpp.runtime.zero.partition_parameters`
(``Init``, ``GatheredParameters``, the parameter status values) and
:mod:`~zpp.runtime.zero.config` (``DeepSpeedZeroConfig``), under the names DeepSpeed's
users import them by. The engine itself is :mod:`zpp.zero`."""
from zpp.compat.runtime.zero import config, partition_parameters
from zpp.compat.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "config", "partition_parameters",
           "register_external_parameter", "unregister_external_parameter"]
