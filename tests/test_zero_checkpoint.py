"""Sharded checkpoints: save -> load -> continue gives the losses of not stopping, and a
4-rank (2 nodes x 2) checkpoint reshards onto 2 ranks exactly (weights and Adam state) and
trains on there as plain torch AdamW from the saved state does."""
import json
import math
from pathlib import Path

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, GPTConfig
from tests.test_zero_engine import OddNet
from zpp.zero.checkpoint import _collect


def _model(kind, seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)) if kind == "gpt" else OddNet()


def _batch(kind, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "gpt":
        x = torch.randint(0, 128, (4, 16), generator=g)
        return x, x
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def _cfg(stage, gas=1, bf16=False):
    return {
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_num_steps": 3, "warmup_max_lr": 5e-3, "total_num_steps": 20}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }


def _train(engine, kind, rank, steps):
    losses = []
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps):
            loss = engine(*_batch(kind, rank, 10 * step + micro))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _save_and_continue(t, root):
    out = {}
    for kind, stage, gas, bf16 in [("gpt", 3, 1, False), ("odd", 1, 2, True), ("odd", 3, 1, False)]:
        name = f"{kind}-s{stage}-gas{gas}-{'bf16' if bf16 else 'fp32'}"
        cfg = _cfg(stage, gas, bf16)
        e1, *_ = zz.initialize(model=_model(kind, 0), config=cfg, transport=t)
        _train(e1, kind, t.rank, range(3))
        e1.save_checkpoint(f"{root}/{name}")
        if t.rank == 0:
            torch.save(e1.consolidated_state_dict(), f"{root}/{name}/consolidated.pt")
        else:
            e1.consolidated_state_dict()
        straight = _train(e1, kind, t.rank, range(3, 6))
        e1.close()
        e2, *_ = zz.initialize(model=_model(kind, 99), config=cfg, transport=t)  # other init
        e2.load_checkpoint(f"{root}/{name}")
        assert e2.global_steps == 3
        resumed = _train(e2, kind, t.rank, range(3, 6))
        out[name] = (straight, resumed)
        e2.close()
    return out


RESUMED_STEPS = range(3, 6)


def _reshard(t, root):
    """Load the 4-rank stage-3 checkpoint on 2 ranks (stage 3 and stage 1), save it again,
    train on; per stage, this rank's losses and the weights at the end."""
    name = "gpt-s3-gas1-fp32"
    want = torch.load(f"{root}/{name}/consolidated.pt")
    out = {}
    for stage in (3, 1):
        e, *_ = zz.initialize(model=_model("gpt", 7), config=_cfg(stage), transport=t)
        e.load_checkpoint(f"{root}/{name}")
        got = e.consolidated_state_dict()
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        e.save_checkpoint(f"{root}/resharded-s{stage}")
        losses = _train(e, "gpt", t.rank, RESUMED_STEPS)
        out[stage] = (losses, e.consolidated_state_dict())
        e.close()
    return out


def _lr(step):
    """_cfg's WarmupDecayLR written out (DeepSpeed's formula): log warm-up over 3 steps to
    5e-3, then linear decay to 0 at step 20."""
    return 5e-3 * (math.log(step + 1) / math.log(3) if step < 3 else (20 - step) / 17)


def _reference_continuation(root, name, world):
    """What training on from the checkpoint must give, in plain torch in this process: the
    checkpoint's weights (the 4-rank run's consolidated state) and Adam moments and step,
    ``world`` ranks' batches, the mean of their gradients, ``clip_grad_norm_(1.0)`` and
    ``torch.optim.AdamW`` (DeepSpeed's "Adam" with weight decay) at :func:`_lr`. Returns
    each rank's losses and the final state dict."""
    model = _model("gpt", 0)
    model.load_state_dict(torch.load(f"{root}/{name}/consolidated.pt"))
    src = Path(root, name, "global_step3")
    saved = _collect(src, json.loads((src / "meta.json").read_text()))
    params = dict(model.named_parameters())
    assert sorted(saved) == sorted(params), (sorted(saved), sorted(params))
    opt = torch.optim.AdamW(list(params.values()), lr=_lr(3), weight_decay=0.01, foreach=False)
    for n, p in params.items():
        assert torch.equal(saved[n]["values"].view_as(p), p.detach()), n
        opt.state[p] = {"step": torch.tensor(float(saved[n]["step"])),
                        "exp_avg": saved[n]["exp_avg"].view_as(p).clone(),
                        "exp_avg_sq": saved[n]["exp_avg_sq"].view_as(p).clone()}
    losses = [[] for _ in range(world)]
    for step in RESUMED_STEPS:
        grads = []
        for rank in range(world):
            model.zero_grad()
            loss = model(*_batch("gpt", rank, 10 * step))
            loss.backward()
            losses[rank].append(loss.item())
            grads.append([p.grad.clone() for p in params.values()])
        for i, p in enumerate(params.values()):
            p.grad = sum(g[i] for g in grads) / world
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(600)  # two worlds of up to 290 s each (see tests.dist.world_timeout)
def test_save_load_continue_and_reshard(tmp_path):
    root = str(tmp_path)
    results = run_world(_save_and_continue, 4, ranks_per_node=2, args=(root,), timeout=290)
    for rank, res in enumerate(results):
        for name, (straight, resumed) in res.items():
            assert straight == resumed, (rank, name, straight, resumed)
    meta = json.loads(Path(root, "gpt-s3-gas1-fp32", "global_step3", "meta.json").read_text())
    assert meta["world_size"] == 4 and meta["global_steps"] == 3
    assert Path(root, "gpt-s3-gas1-fp32", "latest").read_text() == "global_step3"
    assert not list(Path(root).rglob(".*.tmp*"))  # every write was atomic and finished
    resumed = run_world(_reshard, 2, args=(root,), timeout=290)
    # training on after the reshard is the plain-torch continuation of the saved state
    ref_losses, ref_state = _reference_continuation(root, "gpt-s3-gas1-fp32", 2)
    for stage in (3, 1):
        for rank in range(2):
            losses, state = resumed[rank][stage]
            torch.testing.assert_close(losses, ref_losses[rank], rtol=2e-5, atol=0,
                                       msg=lambda m, s=stage, r=rank: f"stage {s} rank {r} losses: {m}")
            assert list(state) == list(ref_state)
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], rtol=0, atol=2e-5,
                                           msg=lambda m, s=stage, k=k: f"stage {s} {k}: {m}")
    # the 2-rank re-save holds exactly what the 4-rank checkpoint held, by parameter
    src = Path(root, "gpt-s3-gas1-fp32", "global_step3")
    a = _collect(src, json.loads((src / "meta.json").read_text()))
    for stage in (3, 1):
        dst = Path(root, f"resharded-s{stage}", "global_step3")
        b = _collect(dst, json.loads((dst / "meta.json").read_text()))
        assert sorted(a) == sorted(b)
        for n in a:
            assert sorted(a[n]) == sorted(b[n]) == ["exp_avg", "exp_avg_sq", "step", "values"], (n, sorted(b[n]))
            for k in a[n]:
                assert torch.equal(a[n][k], b[n][k]), (stage, n, k)
