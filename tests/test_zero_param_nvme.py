"""Parameters on NVMe (offload_param.device "nvme", stage 3; [Note: parameters on NVMe] in
zpp/zero/param_swap.py): training equals the in-memory run to the bit (fp32 and bf16, with the
optimizer state in memory or on NVMe too, a model built under zpp.zero.Init), between steps the
shards are in the file only (ds_tensor empty meanwhile), after the first step every read runs ahead
of its use, checkpoints move between the tiers both ways without bringing the shards into
memory, a modified gather is written back, a corrupt file raises at the gather, and a bad path
fails every rank before training."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, GPTConfig
from tests.test_zero_engine import _batches, train_steps
from zpp.zero.memory import model_state_bytes


def _config(params=None, optimizer=None, bf16=False, buffer_count=3):
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
           "aio": {"block_size": 8192, "queue_depth": 2, "thread_count": 2}}
    if params is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": params,
                                                     "buffer_count": buffer_count}
    if optimizer is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": optimizer, "buffer_count": 2}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _model(n_layer=3):
    torch.manual_seed(1234)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, block_size=16))


def _weights(engine):
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


def _train(t, root, bf16, optimizer_on_disk, init):
    batches = _batches("gpt", t.rank, 6)
    out = {}
    for name, path in (("memory", None), ("nvme", root)):
        cfg = _config(path, root if (path and optimizer_on_disk) else None, bf16)
        if init:
            with zz.Init(config_dict_or_path=cfg, transport=t):
                model = _model()
        else:
            model = _model()
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        rec = {"losses": train_steps(engine, batches[:2])}
        if path is not None:
            swap = engine.comms.params_swap
            sharded = [u for u in engine.units if u.shards_params]
            rec["units"] = len(sharded)
            rec["on_disk"] = sum(u.on_disk for u in sharded)
            rec["kept"] = len(swap._kept)
            before = dataclasses.asdict(swap.stats)
            written = swap.swap.written_bytes
            u = next(u for u in sharded if u.on_disk)
            rec["ds_tensor_on_disk"] = [(p.ds_tensor.numel(), p.partition_numel()) for p in u.params]
            rec["storage_on_disk"] = u.flat.shard.untyped_storage().nbytes()
            states = model_state_bytes(engine.units, engine.optimizer, engine.modes)
            rec["params_bytes"] = states["params"]
            rec["buffer_bytes"] = swap.buffers.nbytes
            rec["largest_shard"] = max(u.flat.shard.numel() * u.flat.shard.element_size()
                                       + (u.flat.master.numel() * 4 if bf16 and u.flat.master is not None else 0)
                                       for u in sharded)
        rec["losses"] += train_steps(engine, batches[2:])
        if path is not None:
            after = dataclasses.asdict(swap.stats)
            rec["delta"] = {k: after[k] - before[k] for k in after}
            rec["written_per_step"] = (swap.swap.written_bytes - written) / 4
            rec["file_bytes"] = swap.swap.end
            rec["file"] = str(swap.swap.path)
        rec["weights"] = _weights(engine)
        engine.close()
        if path is not None:
            rec["exists_after_close"] = Path(rec["file"]).exists()
        out[name] = rec
    return out


@pytest.mark.parametrize("bf16,optimizer_on_disk,init", [(False, False, False), (False, True, False),
                                                        (True, True, False), (False, False, True)])
def test_parameters_on_nvme_train_equal_to_memory_to_the_bit(tmp_path, bf16, optimizer_on_disk, init):
    for r in run_world(_train, 2, args=(str(tmp_path), bf16, optimizer_on_disk, init), timeout=180):
        mem, nv = r["memory"], r["nvme"]
        assert nv["losses"] == mem["losses"]
        assert nv["weights"].keys() == mem["weights"].keys()
        for k, v in mem["weights"].items():
            assert torch.equal(nv["weights"][k], v), k
        # between steps every shard is in the file only (but those the next step uses first,
        # at most buffer_count - 1 = 2)
        assert nv["units"] >= 4 and nv["on_disk"] >= nv["units"] - 2 and nv["on_disk"] + nv["kept"] == nv["units"]
        # a shard on disk holds no memory; ds_tensor is empty meanwhile, partition_numel() its size
        assert nv["storage_on_disk"] == 0
        assert all(n == 0 for n, _ in nv["ds_tensor_on_disk"]) and sum(s for _, s in nv["ds_tensor_on_disk"]) > 0
        # zpp's count of its parameter memory: the shards in memory and the tier's buffers
        assert nv["params_bytes"] <= (nv["units"] - nv["on_disk"]) * nv["largest_shard"] + nv["buffer_bytes"]
        # buffer_count buffers, and one more while a gradient is read ahead of the step
        assert nv["buffer_bytes"] <= (3 + 1) * (nv["largest_shard"] + 2 * 4096)  # each tensor padded to 4 KiB
        # after the first step the order is traced: four steps, every read ahead of its use,
        # three uses per unit and step (forward, backward, optimizer), each unit written once a step
        d = nv["delta"]
        assert d["sync_reads"] == 0 and d["mismatches"] == 0, d
        assert d["read_ahead"] == d["reads"] > 0
        assert d["reads"] + 4 * nv["kept"] <= 3 * 4 * nv["units"]
        assert d["writes"] == 4 * nv["units"]
        assert nv["written_per_step"] == nv["file_bytes"]
        assert not nv["exists_after_close"]


def _roundtrip(t, root):
    batches = _batches("gpt", t.rank, 6)
    e, *_ = zz.initialize(model=_model(), config=_config(), transport=t)
    out = {"ref": train_steps(e, batches)}
    e.close()
    for first, second in (("nvme", "memory"), ("memory", "nvme")):
        path = {"nvme": str(Path(root) / "swap"), "memory": None}
        e, *_ = zz.initialize(model=_model(), config=_config(path[first]), transport=t)
        losses = train_steps(e, batches[:3])
        if first == "nvme":
            resident = [u.index for u in e.units if u.shards_params and not u.on_disk]
        e.save_checkpoint(str(Path(root) / f"ckpt-{first}"), tag="t3")
        if first == "nvme":  # the save read the shards from the file, none came into memory
            out["resident_after_save"] = [u.index for u in e.units if u.shards_params and not u.on_disk] == resident
        e.close()
        e, *_ = zz.initialize(model=_model(), config=_config(path[second]), transport=t)
        e.load_checkpoint(str(Path(root) / f"ckpt-{first}"), tag="t3")
        if second == "nvme":
            out["on_disk_after_load"] = all(u.on_disk for u in e.units if u.shards_params)
        losses += train_steps(e, batches[3:])
        out[f"{first}->{second}"] = losses
        e.close()
    return out


def test_checkpoints_move_between_parameters_on_nvme_and_memory_exactly(tmp_path):
    for r in run_world(_roundtrip, 2, args=(str(tmp_path),), timeout=200):
        assert r["nvme->memory"] == r["ref"]
        assert r["memory->nvme"] == r["ref"]
        assert r["resident_after_save"] and r["on_disk_after_load"]


def _modified(t, root):
    batches = _batches("gpt", t.rank, 3)
    out = {}
    for name, path in (("memory", None), ("nvme", root)):
        e, *_ = zz.initialize(model=_model(), config=_config(path), transport=t)
        losses = train_steps(e, batches[:1])
        block = e.module.blocks[1]
        before = _weights(e)["blocks.1.qkv.weight"]
        with zz.GatheredParameters(list(block.parameters()), modifier_rank=0):
            if t.rank == 0:
                with torch.no_grad():
                    block.qkv.weight.mul_(0.5)
        if path is not None:
            out["on_disk"] = all(u.on_disk or u.index in e.comms.params_swap._kept
                                 for u in e.units if u.shards_params)
        out[f"{name}_halved"] = torch.equal(_weights(e)["blocks.1.qkv.weight"], before * 0.5)  # read back
        losses += train_steps(e, batches[1:])
        out[name] = (losses, _weights(e))
        e.close()
    return out


def test_a_gathered_modification_is_written_back_to_the_file(tmp_path):
    for r in run_world(_modified, 2, args=(str(tmp_path),), timeout=150):
        (lm, wm), (ln, wn) = r["memory"], r["nvme"]
        assert ln == lm and r["on_disk"] and r["memory_halved"] and r["nvme_halved"]
        for k, v in wm.items():
            assert torch.equal(wn[k], v), k


def _corrupt(t, root):
    batches = _batches("gpt", t.rank, 3)
    e, *_ = zz.initialize(model=_model(), config=_config(root, buffer_count=2), transport=t)
    train_steps(e, batches[:2])
    swap = e.comms.params_swap
    swap.buffers.finish_writes()
    fd = os.open(swap.swap.path, os.O_WRONLY)  # something else writes over every shard in the file
    os.pwrite(fd, b"\xff" * swap.swap.end, 0)
    os.fsync(fd)
    os.close(fd)
    x, y = batches[2]
    try:
        e(x, y)
    except OSError as ex:
        return str(ex)
    return None


def test_a_corrupt_parameter_file_raises_at_the_gather(tmp_path):
    for msg in run_world(_corrupt, 2, args=(str(tmp_path),), timeout=120, transport_kwargs={"timeout_s": 20}):
        assert msg is not None and "is corrupt" in msg and "param_rank0000" in msg, msg
        assert "parameter shard there is lost" in msg


def _bad_path(t, path):
    try:
        zz.initialize(model=_model(), config=_config(path), transport=t)
    except ValueError as e:
        return str(e)
    return None


def test_an_unwritable_parameter_path_fails_on_every_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for msg in run_world(_bad_path, 2, args=(str(blocker / "swap"),), timeout=90):
        assert msg is not None and "offload_param.nvme_path=" in msg and "a-file" in msg


def test_the_hierarchical_mode_refuses_parameters_on_nvme():
    from zpp.zero.deepspeed_config import from_deepspeed

    with pytest.raises(NotImplementedError, match="offload_param.device='nvme' with zpp.outer"):
        from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
                        "zpp": {"outer": {"sync_every": 5}}})


def _accumulate(t, root, fp16):
    batches = _batches("gpt", t.rank, 8)
    out = {}
    for name, path in (("memory", None), ("nvme", root)):
        cfg = _config(path)
        cfg.update(gradient_accumulation_steps=2, train_micro_batch_size_per_gpu=4, gradient_clipping=0.05)
        if fp16:  # a first scale of 2^19 overflows: skipped steps drop the gradients on disk too
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 19, "hysteresis": 1}
        e, *_ = zz.initialize(model=_model(), config=cfg, transport=t)
        losses, norms, after_backward = [], [], []
        for i, (x, y) in enumerate(batches):
            loss = e(x, y)
            e.backward(loss)
            if path is not None and i == 2:  # mid-accumulation: every reduced gradient is in the file
                after_backward = [(u.flat.grad is None, u.grad_on_disk) for u in e.units if u.trainable]
            e.step()
            losses.append(loss.item())
            if i % 2 == 1:
                norms.append(e.last_grad_norm)
        rec = {"losses": losses, "norms": norms, "weights": _weights(e), "skipped": e.skipped_steps}
        if path is not None:
            rec["after_backward"] = after_backward
            rec["stats"] = dataclasses.asdict(e.comms.params_swap.stats)
            rec["trained"] = sum(1 for u in e.units if u.trainable)
        e.close()
        out[name] = rec
    return out


@pytest.mark.parametrize("fp16", [False, True])
def test_gradients_on_nvme_accumulate_and_clip_as_in_memory(tmp_path, fp16):
    for r in run_world(_accumulate, 2, args=(str(tmp_path), fp16), timeout=150):
        mem, nv = r["memory"], r["nvme"]
        assert nv["losses"] == mem["losses"] and nv["norms"] == mem["norms"]
        assert nv["skipped"] == mem["skipped"] and (mem["skipped"] > 0) == fp16
        assert max(n for n in mem["norms"] if n != float("inf")) > 0.05  # clipping was active
        for k, v in mem["weights"].items():
            assert torch.equal(nv["weights"][k], v), k
        assert nv["after_backward"] and all(gone and on for gone, on in nv["after_backward"])
        s, n = nv["stats"], nv["trained"]
        # 8 micro-steps: each written after its reduction; read back to accumulate (4 times) and for
        # each step applied (a skipped step drops them unread)
        assert s["grad_writes"] == 8 * n and s["grad_reads"] == (8 - nv["skipped"]) * n
        assert 0 < s["grad_read_ahead"] <= s["grad_reads"]


def _close_empty(t, root):
    e, *_ = zz.initialize(model=_model(), config=_config(root), transport=t)
    train_steps(e, _batches("gpt", t.rank, 2))
    path = e.comms.params_swap.swap.path
    e.close(gather_weights=False)
    sharded = [u for u in e.units if u.shards_params]
    return {"empty": all(p.numel() == 0 for u in sharded for p in u.params),
            "freed": all(u._full.untyped_storage().nbytes() == 0 for u in sharded),
            "removed": not path.exists(), "hooks": len(e.hooks.handles)}


def test_close_without_gathering_leaves_a_model_larger_than_memory_unmaterialized(tmp_path):
    for r in run_world(_close_empty, 2, args=(str(tmp_path),), timeout=90):
        assert r == {"empty": True, "freed": True, "removed": True, "hooks": 0}
