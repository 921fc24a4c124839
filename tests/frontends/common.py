"""What the front-end scripts share: a tiny GPT-2 from a config, a fixed token data set,
the DeepSpeed config, the front-ends' own CPU refusals stepped around, and the result file.

The scripts beside this module are user scripts: each trains through one front-end (the
Hugging Face Trainer, accelerate, Lightning) and knows nothing of zpp. Run under ``zpp run``
their ``import deepspeed`` is zpp; run in an environment with DeepSpeed it is DeepSpeed;
with ``--engine ddp`` the front-end trains with plain torch DDP (the reference).

[Note: the front-ends' CPU refusals]
None of the three front-ends drives DeepSpeed on a machine without a GPU, whichever
DeepSpeed it is; these are theirs, not zpp's, and :func:`allow_cpu` steps around them:
* accelerate (and the Trainer through it) picks no distributed backend without a GPU
  unless ``cpu=True``, which turns DeepSpeed off: ``PartialState._prepare_backend`` is made to
  answer ("gloo", MULTI_CPU) when a launcher set ``LOCAL_RANK``.
* Lightning's DeepSpeed strategy refuses a non-CUDA accelerator in ``setup_environment``,
  checks CUDA device indices, and passes ``root_device.index`` (None on CPU) to
  ``initialize``: the first is DDP's ``setup_environment`` instead, the second a no-op, the
  third ``cpu:0`` (real DeepSpeed compares the index with 0; zpp ignores it).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time

import torch


def _yield_gil_at_exit() -> None:
    """Give the GIL up briefly before the interpreter finalizes. torch 2.13's gloo workers drop
    a finished collective's tensors after its ``wait()`` returned, which takes the GIL; one that
    gets there during finalization aborts the process after correct results ("terminate
    called without an active exception"; seen on the DDP reference runs, which have no zpp:
    zpp's own groups get the same pause, see [Note: clean exit] in zpp/comm/teardown.py)."""
    time.sleep(0.05)


atexit.register(_yield_gil_at_exit)  # registered first, so it runs last

VOCAB, SEQ = 1000, 32


def arguments(save_help: str, resume_help: str) -> argparse.ArgumentParser:
    """The options every script takes (a script adds its own)."""
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["deepspeed", "ddp"], default="deepspeed")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--zeropp", action="store_true")
    p.add_argument("--hpz", type=int, default=1, help="zero_hpz_partition_size (with --zeropp)")
    p.add_argument("--zpp", default=None, help="zpp's own config section, as JSON (e.g. '{\"weight_delta_bits\": 4}')")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--save-at", type=int, default=0, help=save_help)
    p.add_argument("--resume", default=None, help=resume_help)
    p.add_argument("--dir", default="out", help="where checkpoints (and the Trainer's model) go")
    p.add_argument("--out", required=True, help="the result file (JSON)")
    return p


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tokens(n: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def ds_config(stage: int, *, micro: int | None, gas: int | None, zeropp: bool = False, scheduler: dict | None = None,
              optimizer: dict | None = None, hpz: int = 1, zpp: str | None = None) -> dict:
    """The DeepSpeed config; ``micro`` / ``gas`` None leave those keys to the front-end
    (Lightning refuses them in the config)."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    if zeropp:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
        if hpz > 1:
            zero["zero_hpz_partition_size"] = hpz
    cfg = {"gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 1000,
           "zero_allow_untested_optimizer": True}  # Lightning reads it at stage 3 evaluation
    if micro is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro
    if gas is not None:
        cfg["gradient_accumulation_steps"] = gas
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    if zpp is not None:
        cfg["zpp"] = json.loads(zpp)
    return cfg


def allow_cpu() -> None:
    """Step around the front-ends' own CPU refusals; see [Note: the front-ends' CPU refusals]."""
    if torch.cuda.is_available():
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if int(os.environ.get("LOCAL_RANK", -1)) != -1 and not cpu:
            return "gloo", DistributedType.MULTI_CPU
        return original(self, cpu, sagemaker_dp, backend)

    PartialState._prepare_backend = prepare_backend

    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy
    from pytorch_lightning.strategies import deepspeed as lightning_deepspeed

    DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment  # skips the CUDA-only refusal
    lightning_deepspeed._validate_device_index_selection = lambda devices: None
    # DeepSpeed's engine compares args.device_rank (root_device.index) with 0: a CPU device with index 0
    DeepSpeedStrategy.root_device = property(lambda self: torch.device("cpu", 0))


def which_deepspeed() -> str:
    """"zpp", "deepspeed" (the real one) or "none", for the result file."""
    try:
        import deepspeed
    except ImportError:
        return "none"
    return "zpp" if getattr(deepspeed, "__zpp__", False) else f"deepspeed {deepspeed.__version__}"


def write_result(path: str, record: dict) -> None:
    """Rank 0 writes ``record`` (plus which deepspeed ran) as JSON."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    record = {**record, "deepspeed": which_deepspeed(), "argv": sys.argv[1:]}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
