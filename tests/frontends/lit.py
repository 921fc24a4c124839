"""A user's Lightning script: a tiny GPT-2 LightningModule with its AdamW and warm-up
schedule in ``configure_optimizers``, gradient accumulation, validation, a checkpoint and
resume, on ``strategy=DeepSpeedStrategy(config=...)`` (or "ddp"). See tests/frontends/common.py.

    zpp run python tests/frontends/lit.py --stage 3 --out r.json     # Lightning starts the 2 ranks
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

p = common.arguments(save_help="checkpoint at the end of each epoch (0: no)",
                     resume_help="ckpt_path to resume from")
p.add_argument("--epoch-steps", type=int, default=10, help="optimizer steps per epoch (the data repeats)")
args = p.parse_args()

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402

WORLD = 2
#: Lightning divides the training step's loss by accumulate_grad_batches on every strategy, and
#: DeepSpeed's engine divides it by gradient_accumulation_steps again (real DeepSpeed 0.19.8 as
#: well as zpp, which matches it): on DeepSpeed the gradients are 1/gas of DDP's. Adam hides most
#: of a uniform scale, not all (eps, the clipping threshold), so the DDP reference (--engine ddp)
#: divides once more and trains the same numbers.
SAME_GRADIENTS = True


class TinyGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = common.tiny_gpt2(0)

    def training_step(self, batch, _):
        loss = self.model(input_ids=batch, labels=batch).loss
        if args.engine == "ddp":  # see SAME_GRADIENTS
            loss = loss / args.gas
        return loss

    def validation_step(self, batch, _):
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 6))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(Callback):
    def __init__(self):
        self.losses, self.lrs = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().reshape(1) * (args.gas if args.engine == "ddp" else 1)  # SAME_GRADIENTS
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())
        if (batch_idx + 1) % args.gas == 0:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


strategy = "ddp"
if args.engine == "deepspeed":
    common.allow_cpu()
    from pytorch_lightning.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(config=common.ds_config(args.stage, micro=None, gas=None, zeropp=args.zeropp))
# epochs of --epoch-steps steps: a checkpoint at an epoch's end resumes on the data the uninterrupted run
# sees next (Lightning restarts an epoch it resumes in the middle of, with a plain DataLoader)
data = torch.utils.data.DataLoader(common.tokens(args.epoch_steps * args.gas * args.micro * WORLD),
                                   batch_size=args.micro)
val = torch.utils.data.DataLoader(common.tokens(4 * WORLD, seed=9), batch_size=2)
record = Record()
callbacks = [record]
if args.save_at:
    callbacks.append(ModelCheckpoint(dirpath=args.dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True))
trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.steps,
                     accumulate_grad_batches=args.gas, gradient_clip_val=1.0 if args.engine == "ddp" else None,
                     callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=None, val_check_interval=None,
                     use_distributed_sampler=True,
                     deterministic=False)
module = TinyGPT()
trainer.fit(module, data, val, ckpt_path=args.resume)
metrics = trainer.validate(module, val, verbose=False)[0]
if int(os.environ.get("LOCAL_RANK", "0")) == 0 and trainer.global_rank == 0:
    common.write_result(args.out, {"losses": record.losses, "lrs": record.lrs, "eval": metrics["val_loss"],
                                   "steps": trainer.global_step})
