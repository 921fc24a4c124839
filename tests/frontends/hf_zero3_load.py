"""A user's script that loads a pretrained Hugging Face model under ZeRO-3, as
``TrainingArguments(deepspeed=...)`` arranges it: with a ZeRO-3 config registered
(``HfDeepSpeedConfig``), ``from_pretrained`` builds the model under ``deepspeed.zero.Init``
(each rank holds its shards only) and loads the weights through
``deepspeed.zero.GatheredParameters``; ``deepspeed.initialize`` then trains it.

    zpp run torchrun --nproc-per-node 2 tests/frontends/hf_zero3_load.py --pretrained DIR --out r.json
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--pretrained", required=True, help="a save_pretrained folder of common.tiny_gpt2")
p.add_argument("--out", required=True)
args = p.parse_args()

import deepspeed  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

deepspeed.init_distributed("gloo")
config = common.ds_config(3, micro=2, gas=1)
registered = HfDeepSpeedConfig(config)  # kept alive: transformers reads it in from_pretrained
model = GPT2LMHeadModel.from_pretrained(args.pretrained)
params = list(model.parameters())
partitioned = {"all_have_ds_numel": all(hasattr(q, "ds_numel") for q in params),
               "ds_numel": sum(q.ds_numel for q in params),
               "local_numel": sum(q.numel() for q in params),
               "status": str(params[0].ds_status)}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
state = engine._zero3_consolidated_16bit_state_dict()  # rank 0: the weights it loaded, whole
losses = []
data = common.tokens(2 * 3 * 2, seed=5)
rank = torch.distributed.get_rank()
for i in range(3):
    batch = data[(i * 2 + rank) * 2:(i * 2 + rank) * 2 + 2]
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if state is not None:
    torch.save(state, Path(args.out).with_suffix(".state.pt"))
common.write_result(args.out, {**partitioned, "losses": losses})
