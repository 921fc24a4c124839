"""A user's accelerate script: a tiny GPT-2, the user's AdamW and warm-up schedule,
gradient accumulation, eval, save_state and resume. See tests/frontends/common.py.

    zpp run torchrun --nproc-per-node 2 tests/frontends/accel.py --stage 3 --out r.json
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

p = common.arguments(save_help="save_state after this many steps (0: no)",
                     resume_help="load_state from this folder first")
args = p.parse_args()

common.allow_cpu()
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

plugin = None
if args.engine == "deepspeed":
    plugin = DeepSpeedPlugin(hf_ds_config=common.ds_config(args.stage, micro=args.micro, gas=args.gas,
                                                            zeropp=args.zeropp))
accelerator = Accelerator(gradient_accumulation_steps=args.gas, deepspeed_plugin=plugin)
model = common.tiny_gpt2(0)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 6))
world = accelerator.num_processes
data = common.tokens(args.steps * args.gas * args.micro * world)
loader = torch.utils.data.DataLoader(data, batch_size=args.micro, shuffle=False)
eval_loader = torch.utils.data.DataLoader(common.tokens(4 * world, seed=9), batch_size=2, shuffle=False)
model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, loader, eval_loader,
                                                                        scheduler)
start = 0
if args.resume:
    accelerator.load_state(args.resume)
    start = args.save_at
    loader = accelerator.skip_first_batches(loader, start * args.gas)

losses, lrs = [], []
step = start
for batch in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed: the config's gradient_clipping
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    losses.append(accelerator.gather(loss.detach().reshape(1)).mean().item())
    if accelerator.sync_gradients:
        step += 1
        lrs.append(scheduler.get_last_lr()[0])
        if step == args.save_at and not args.resume:
            accelerator.save_state(args.dir)

model.eval()
with torch.no_grad():
    eval_losses = [accelerator.gather(model(input_ids=b, labels=b).loss.reshape(1)).mean().item()
                   for b in eval_loader]
common.write_result(args.out, {"losses": losses, "lrs": lrs, "eval": sum(eval_losses) / len(eval_losses),
                               "steps": step})
accelerator.end_training()
