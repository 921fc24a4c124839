"""DeepSpeed's optimizer-name constants (``deepspeed.runtime.config``), as scripts compare
them with ``engine.optimizer_name()``:

    args.use_lamb = engine.optimizer_name() == deepspeed.runtime.config.LAMB_OPTIMIZER

The values are DeepSpeed's (lower-case names). zpp's engine builds ``ZPP_OPTIMIZERS`` from a
config's ``optimizer.type``; the rest are names DeepSpeed knows and zpp refuses.
"""
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
]
#: The names zpp's engine builds from a config (``zpp.zero.config.OPTIMIZERS``; "sgd" is
#: torch's, which DeepSpeed reaches through ``torch.optim``).
ZPP_OPTIMIZERS = [ADAM_OPTIMIZER, ADAMW_OPTIMIZER, "sgd", ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER,
                  ONEBIT_LAMB_OPTIMIZER]

# extra parameters of DeepSpeed's Adam/AdamW in the config
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = [name for name in dir() if name.isupper()]
