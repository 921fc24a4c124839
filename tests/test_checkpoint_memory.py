"""A checkpoint holds no second copy of the model states (see [Note: NVMe swap] in
zpp/zero/nvme.py and [Note: no half-loaded engine] in zpp/zero/checkpoint/load.py).

A job that fits only because its optimizer state is on NVMe must be able to save and load
without that state in memory: the save writes the offloaded state from read-only maps of the
swap file, and the in-memory states (stage 3 shards, the optimizer's moments) from the
tensors themselves, not from copies; a load assembles and applies one unit at a time, and the
NVMe mode writes each unit's state to its file before the next is built. Checked without a
clock or a memory sampler: where each saved tensor's bytes live (/proc/self/maps), and what
the optimizer holds each time a unit is applied. The values are checked by
tests/test_zero_nvme.py (round trips to the bit)."""
from __future__ import annotations

import os

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from tests.test_zero_engine import _batches, train_steps
from tests.test_zero_nvme import _config, _model
from zpp.zero.checkpoint import save as save_module
from zpp.zero.modes.nvme import NvmeMode


def _mapping(address: int) -> str:
    """The path (or "" for anonymous memory) of the mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"address {address:#x} is in no mapping")


def _per_element(state: dict) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]


def _save_and_load(t, root, nvme):
    engine, *_ = zz.initialize(model=_model(), config=_config(3, nvme=nvme), transport=t)
    train_steps(engine, _batches("gpt", t.rank, 2))
    opt = engine.optimizer
    trained = [u for u in engine.units if u.trainable and u.flat.master.numel() > 0]
    owned = {u.flat.master.data_ptr() for u in trained}
    owned |= {v.data_ptr() for u in trained for v in opt.state.get(u.flat.master, {}).values()
              if isinstance(v, torch.Tensor) and v.dim() > 0}
    seen, fds = [], []

    def entries(engine, exclude_frozen):  # what the shard file is written from
        before = len(os.listdir("/proc/self/fd"))
        out = real(engine, exclude_frozen)
        fds.append(len(os.listdir("/proc/self/fd")) - before)  # maps of the swap file hold descriptors
        for e in out:
            if e["trainable"] and e["values"].numel():
                tensors = [e["values"]] + [v for v in e["optim"].values() if isinstance(v, torch.Tensor) and v.dim()]
                seen.extend((tuple(e["names"]), x.data_ptr(), _mapping(x.data_ptr())) for x in tensors)
        return out

    real = save_module._unit_entries
    save_module._unit_entries = entries
    try:
        engine.save_checkpoint(root, tag="t")
    finally:
        save_module._unit_entries = real
    swap = str(engine.mode("nvme").swap.path) if nvme else None

    held = []  # at each unit applied: the units whose per-element state is in memory
    if nvme:
        hook = NvmeMode.optimizer_state_loaded

        def loaded(self, unit):
            held.append(sum(1 for s in opt.state.values() if _per_element(s)))
            hook(self, unit)
        NvmeMode.optimizer_state_loaded = loaded
    try:
        engine.load_checkpoint(root, tag="t")
    finally:
        if nvme:
            NvmeMode.optimizer_state_loaded = hook
    after = [k for s in opt.state.values() for k in _per_element(s)]
    engine.close()
    return {"seen": seen, "owned": owned, "swap": swap, "held": held, "after": after, "units": len(trained),
            "fds": fds}


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_save_copies_no_model_state_and_a_load_holds_one_unit(tmp_path, offload):
    nvme = str(tmp_path / "nvme") if offload == "nvme" else None
    for r in run_world(_save_and_load, 2, args=(str(tmp_path / "ckpt"), nvme), timeout=150):
        assert r["units"] >= 3 and r["seen"]
        for names, ptr, where in r["seen"]:
            if nvme:  # the master is the engine's own; the moments are the swap file's pages
                assert ptr in r["owned"] or where == r["swap"], (names, where)
            else:  # stage 3: the shard and the moments themselves, no copies
                assert ptr in r["owned"], (names, where)
        if nvme:
            moments = [w for _, p, w in r["seen"] if p not in r["owned"]]
            assert len(moments) == 2 * r["units"] and set(moments) == {r["swap"]}
            # each unit's state goes to the file before the next unit's is built
            assert r["held"] == [1] * r["units"] and r["after"] == []
        assert r["fds"][0] <= 1, r["fds"]  # one map of the swap file for the whole save, not one per unit


def test_a_saved_parameter_is_cut_from_the_shards_it_spans():
    """load.SavedParameter against the concatenation it replaces: a parameter inside one
    rank's shard, one across two, one of no elements, and a per-tensor scalar."""
    from zpp.zero.checkpoint.load import SavedParameter

    full = {"values": torch.arange(10.0), "exp_avg": torch.arange(10.0) * 2}
    entries = [{"start": a, "stop": b, "values": full["values"][a:b],
                "optim": {"exp_avg": full["exp_avg"][a:b], "step": torch.tensor(3.0)}} for a, b in ((0, 6), (6, 10))]
    for off, n in ((0, 4), (4, 5), (9, 0), (9, 1)):
        p = SavedParameter(entries, off, n, ("values", "exp_avg"), {"step": torch.tensor(3.0)})
        assert list(p) == ["values", "exp_avg", "step"] and p.per_element("exp_avg") and not p.per_element("step")
        for k in ("values", "exp_avg"):
            assert torch.equal(p[k], full[k][off:off + n]), (off, n, k)
        assert p["step"].item() == 3.0 and p.numel == n
        with pytest.raises(KeyError):
            p["exp_avg_sq"]
