"""Training modes as plug-ins (:mod:`zpp.zero.modes`): a new mode is one class and one
registry line (the toy mode below), its hooks run in the step's order, its state joins
checkpoints by its reshard rules and comes back on load, and it changes nothing it does not
touch; the engine's step and the checkpoint code name no mode; every mode file is small.
"""
import io
import tokenize
from pathlib import Path

import torch

import zpp.zero as zz
import zpp.zero.checkpoint.load as load_mod
import zpp.zero.checkpoint.save as save_mod
from tests.dist import run_world
from tests.test_zero_engine import _batches, _build, train_steps
from zpp.zero.engine import ZeroEngine
from zpp.zero.modes import MODES, Mode

ROOT = Path(__file__).resolve().parent.parent
MODE_NAMES = ("onebit", "outer", "offload", "loss_scal", "OuterSync", "OneBit", "LossScal", "settle", "nvme")


class ToyMode(Mode):
    """Counts its hooks; keeps per element of each trained shard the sum of the gradients it
    saw (resharded with the units) and per rank the number of steps (its own file)."""

    name = "toy"
    per_rank_file = "toy"

    def __init__(self, engine):
        self.engine = engine
        self.calls = []
        self.steps = 0
        self.sums = {id(u): torch.zeros(u.layout.shard_numel) for u in engine.units if u.trainable}

    @classmethod
    def build(cls, engine):
        return cls(engine) if engine.train_config.zpp.check_metadata is False else None

    def after_reduce(self, trained):
        self.calls.append("after_reduce")

    def before_optimizer_step(self, trained):
        self.calls.append("before_optimizer_step")
        for u in trained:
            self.sums[id(u)] += u.flat.grad

    def after_optimizer_step(self, trained):
        self.calls.append("after_optimizer_step")
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state, *, own):
        self.calls.append(("load", own))
        self.steps = -1 if state is None else state["steps"]

    def unit_state(self, unit):
        s = self.sums.get(id(unit))
        return {} if s is None else {"sum": s.clone()}

    def load_unit_state(self, unit, state):
        if id(unit) in self.sums:
            self.sums[id(unit)] = state["sum"].clone() if state else torch.full_like(self.sums[id(unit)], -1.0)


def _cfg(stage, toy):
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0},
            "zpp": {"check_metadata": False if toy else None}}


def _toy_world(t, tmp):
    MODES["toy"] = ToyMode  # the one line that adds a mode
    try:
        out = {}
        batches = _batches("gpt", t.rank, 3)
        plain, _, _, _ = zz.initialize(model=_build("gpt", 0), config=_cfg(2, False), transport=t)
        assert plain.mode("toy") is None
        out["plain"] = train_steps(plain, batches)
        plain.close()
        e, _, _, _ = zz.initialize(model=_build("gpt", 0), config=_cfg(2, True), transport=t)
        toy = e.mode("toy")
        out["losses"] = train_steps(e, batches)
        out["calls"] = list(toy.calls)
        sums = {i: toy.sums[id(u)].clone() for i, u in enumerate(e.units) if u.trainable}
        e.save_checkpoint(tmp, tag="toy")
        e.close()
        out["files"] = sorted(p.name for p in (Path(tmp) / "toy").iterdir())
        # back into a fresh engine at another stage (other shard ranges: the sums reshard)
        f, _, _, _ = zz.initialize(model=_build("gpt", 0), config=_cfg(1, True), transport=t)
        f.load_checkpoint(tmp, tag="toy")
        toy = f.mode("toy")
        out["loaded"] = (toy.steps, list(toy.calls))
        got = torch.cat([toy.sums[id(u)] for u in f.units if u.trainable])
        out["sums"] = (got.clone(), sums)
        # without the optimizer states the mode starts afresh
        f.load_checkpoint(tmp, tag="toy", load_optimizer_states=False)
        out["fresh"] = (toy.steps, all(float(s.max()) == -1.0 for s in toy.sums.values()))
        f.close()
        return out
    finally:
        MODES.pop("toy")


def test_toy_mode(tmp_path):
    res = run_world(_toy_world, 2, args=(str(tmp_path),), timeout=120)
    for rank, r in enumerate(res):
        assert r["losses"] == r["plain"], rank  # the toy touches nothing
        assert r["calls"] == ["after_reduce", "before_optimizer_step", "after_optimizer_step"] * 3, r["calls"]
        assert "toy_rank00000.pt" in r["files"] and "toy_rank00001.pt" in r["files"], r["files"]
        assert r["loaded"] == (3, [("load", True)]), r["loaded"]
        assert r["fresh"] == (-1, True), r["fresh"]
        got, saved = r["sums"]  # stage 1 cuts the same units and ranges as stage 2 here
        assert float(got.abs().sum()) > 0 and torch.equal(got, torch.cat([saved[i] for i in sorted(saved)])), rank


def _code(path_or_src: str) -> str:
    """Python source without comments and strings (docstrings included)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path_or_src).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            out.append(tok.string)
    return " ".join(out)


def test_step_and_checkpoints_name_no_mode():
    import inspect

    for what, src in (("ZeroEngine.step", inspect.getsource(ZeroEngine.step)),
                      ("ZeroEngine._boundary_step", inspect.getsource(ZeroEngine._boundary_step)),
                      ("ZeroEngine._skip_step", inspect.getsource(ZeroEngine._skip_step)),
                      ("ZeroEngine.backward", inspect.getsource(ZeroEngine.backward)),
                      ("save.py", Path(save_mod.__file__).read_text()),
                      ("load.py", Path(load_mod.__file__).read_text())):
        code = _code(src)
        named = [n for n in MODE_NAMES if n.lower() in code.lower()]
        assert not named, (what, named)


def test_mode_files_are_small():
    for f in sorted((ROOT / "zpp" / "zero" / "modes").glob("*.py")):
        n = len(f.read_text().splitlines())
        assert n <= 250, (f.name, n)
    assert set(MODES) == {"offload", "nvme", "onebit", "outer", "loss_scaler"}
