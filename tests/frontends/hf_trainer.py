"""A user's Hugging Face Trainer script: a tiny GPT-2, gradient accumulation, a warm-up
schedule (the Trainer's own, or DeepSpeed's WarmupLR from the config), evaluation, a
checkpoint and resume, and the final model saved for ``from_pretrained`` (which the test loads in a process of
its own: in this one, transformers would build it under ZeRO-3's ``zero.Init``). See
tests/frontends/common.py.

    zpp run torchrun --nproc-per-node 2 tests/frontends/hf_trainer.py --stage 3 --out r.json
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

p = common.arguments(save_help="checkpoint after this many steps (0: no)",
                     resume_help="resume_from_checkpoint this folder")
p.add_argument("--ds-optim", action="store_true", help="optimizer and WarmupLR from the DeepSpeed config ('auto')")
args = p.parse_args()

common.allow_cpu()
from transformers import Trainer, TrainingArguments  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, t):
        self.t = t

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return {"input_ids": self.t[i], "labels": self.t[i]}


ds_config = None
if args.engine == "deepspeed":
    ds_config = common.ds_config(args.stage, micro=args.micro, gas=args.gas, zeropp=args.zeropp, hpz=args.hpz,
                                 zpp=args.zpp)
    ds_config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                     gradient_clipping="auto", train_batch_size="auto")
    if args.stage == 3:  # as the Trainer's documented ZeRO-3 config: it fills 0.9 x hidden^2
        ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    if args.ds_optim:
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                              "weight_decay": "auto", "torch_adam": True}}
        ds_config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                 "warmup_num_steps": "auto"}}
world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
targs = TrainingArguments(
    output_dir=args.dir, per_device_train_batch_size=args.micro, per_device_eval_batch_size=2,
    gradient_accumulation_steps=args.gas, max_steps=args.steps, learning_rate=2e-3, weight_decay=0.01,
    warmup_steps=5, lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, report_to=[],
    save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or 500, seed=0,
    deepspeed=ds_config, dataloader_drop_last=True)
model = common.tiny_gpt2(0)
train = Tokens(common.tokens(args.steps * args.gas * args.micro * world))
evalset = Tokens(common.tokens(4 * world, seed=9))
trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=evalset)
trainer.train(resume_from_checkpoint=args.resume)
logs = [h for h in trainer.state.log_history if "loss" in h]
metrics = trainer.evaluate()
trainer.save_model(f"{args.dir}/final")
stats = getattr(trainer.model_wrapped, "prefetch_stats", None)  # zpp's engine (stage 3 gathers ahead)
prefetch = None
if stats is not None:
    prefetch = {"prefetched": stats.prefetched, "hits": stats.hits, "window": stats.window_numel}
common.write_result(args.out, {
    "prefetch": prefetch,
    "losses": [h["loss"] for h in logs], "lrs": [h["learning_rate"] for h in logs],
    "grad_norms": [h.get("grad_norm") for h in logs], "steps": [h["step"] for h in logs],
    "eval": metrics["eval_loss"], "final": f"{args.dir}/final",
    "ok": all(math.isfinite(h["loss"]) for h in logs)})
