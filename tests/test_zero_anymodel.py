"""Stage 3 and ZeRO++ train any model torch DDP trains: 20 AdamW steps against DDP, at 2 ranks
and at 2 nodes x 2 ranks, on models that read parameters outside their own module's forward.

Models (tests/models.py): a hand-written LM with functional weight tying, a block applied
twice, ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention``), a 1-element and a
frozen parameter, a buffer and a dict output; the same with activation checkpointing
(``torch.utils.checkpoint``, non-re-entrant and re-entrant, and ``zpp.checkpointing.checkpoint``
as ``deepspeed.checkpointing.checkpoint``); an ``nn.TransformerEncoder`` /
``nn.TransformerDecoder`` seq2seq with a tuple output; Hugging Face GPT-2 (tied LM head),
BERT, Llama and T5 (encoder-decoder) from small configs, GPT-2 also with Hugging Face's
gradient checkpointing in both modes. Every parameter is sharded
(``stage3_param_persistence_threshold: 0``).

Bounds: plain stage 3 and hpZ (which changes where weights come from, not their values)
within 1e-5 relative of DDP's loss at every step (measured: at most 2.3e-7); qwZ (int8
forward weights) and qgZ (int4 gradients) within 1e-2, about three times the worst gap
measured on these models (``ZEROPP_RTOL``). The checkpointed models are compared with DDP on the same model without
checkpointing (the same math).
"""
import pytest
import torch

import zpp.zero as zz
from tests import models
from tests.dist import run_world

STEPS = 20
RTOL = 1e-5
#: bound on the relative loss gap to DDP over 20 steps: the worst measured on these models
#: (2026-12-01: qwZ int8 3.7e-3 on T5, 2.9e-3 elsewhere; qgZ int4 3.7e-3 on T5) times ~3
ZEROPP_RTOL = {"qwz": 1e-2, "qgz": 1e-2}
ZERO = {
    "s3": {},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
}


def _reference(name: str) -> str:
    return name.replace("_ckpt_reentrant", "").replace("_ckpt_deepspeed", "").replace("_ckpt", "")


def _ddp(t, name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, batch, loss_of = models.MODELS[_reference(name)](0)
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        loss = loss_of(ddp(**batch(t.rank, step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _zpp(t, name, switches):
    model, batch, loss_of = models.MODELS[name](0)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **switches}}
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    losses = []
    for step in range(STEPS):
        loss = loss_of(engine(**batch(t.rank, step)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine, model


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _train_all(t, names, variants):
    out = {}
    for name in names:
        ref = _ddp(t, name)
        for v in variants:
            losses, engine, model = _zpp(t, name, ZERO[v])
            out[(name, v)] = _rel(losses, ref)
            assert all(u.flat.full is None for u in engine.units)  # everything released
            engine.close()
    return out


HANDWRITTEN = ["functional_tied", "functional_tied_ckpt", "functional_tied_ckpt_reentrant",
               "functional_tied_ckpt_deepspeed", "seq2seq"]
HF = ["gpt2", "gpt2_ckpt", "gpt2_ckpt_reentrant", "bert", "llama", "t5"]


def _check(results, variants):
    for r in results:
        for (name, v), rel in r.items():
            bound = ZEROPP_RTOL.get(v, RTOL)
            assert rel <= bound, (name, v, rel, bound)


@pytest.mark.parametrize("names", [pytest.param(HANDWRITTEN, id="handwritten"),
                                   pytest.param(HF, id="hf", marks=pytest.mark.slow)])  # hf: 19 s
def test_stage3_two_ranks(names):
    variants = ["s3", "qwz"]
    _check(run_world(_train_all, 2, args=(names, variants), timeout=240), variants)


#: at 2 nodes x 2 ranks, where hpZ and qgZ's two hops exist: one model of each kind of read
#: (re-entrant checkpointing re-gathers from hpZ's secondary shards during backward; the
#: seq2seq's tuple output; tied GPT-2 through Hugging Face's checkpointing; Llama; the
#: encoder-decoder T5). Plain stage 3 and the other checkpointing modes are the same code
#: at any topology: the 2-rank test above runs them on every model.
HANDWRITTEN_2X2 = ["functional_tied_ckpt_reentrant", "seq2seq"]
HF_2X2 = ["gpt2_ckpt", "llama", "t5"]


@pytest.mark.slow  # 25-35 s each; test_stage3_two_ranks[handwritten] stays in the quick lane
@pytest.mark.parametrize("names", [HANDWRITTEN_2X2, HF_2X2], ids=["handwritten", "hf"])
def test_stage3_and_zeropp_two_nodes(names):
    variants = ["hpz", "qwz", "qgz"]
    _check(run_world(_train_all, 4, ranks_per_node=2, args=(names, variants), timeout=280), variants)


def _misuse(t):
    """Reads outside every forward raise, naming the parameter; a second initialize over the
    module closes the first engine; a module swapped after initialize is refused; the
    learned reads are reported."""
    model, batch, loss_of = models.functional_tied(0)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zpp": {"unit_min_numel": 0}}  # one unit per module: the tied read crosses units
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    engine.backward(loss_of(engine(**batch(t.rank, 0))))
    engine.step()
    out = {"learned": sorted({m for m, _ in engine.hooks.learned})}
    try:
        model.emb.weight.sum()
    except RuntimeError as e:
        out["read"] = str(e)
    out["shape_outside"] = tuple(model.emb.weight.shape)  # metadata: harmless, no error
    out["cpu_noop"] = model.cpu() is model  # a move to where it is (Lightning's end of fit): no read
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # state_dict(): the placeholders, with one warning
        warnings.simplefilter("always")
        sd = model.state_dict()
        model.state_dict()
    out["placeholder"] = (tuple(sd["emb.weight"].shape), [str(w.message)[:60] for w in caught])
    try:
        model.emb.weight.to(torch.float64)  # a real conversion reads the values
    except RuntimeError as e:
        out["convert"] = str(e)
    with torch.no_grad():  # evaluation reads everything through forwards
        out["eval"] = float(loss_of(engine(**batch(t.rank, 1))))
    state = engine.consolidated_state_dict()
    # initialize again over the same module (Lightning's evaluation engine): the earlier one is closed
    engine2, *_ = zz.initialize(model=model, config=cfg, transport=t)
    again = engine2.consolidated_state_dict()
    out["twice"] = (engine.hooks.handles == [], sorted(again) == sorted(state),
                    all(torch.equal(again[k], state[k]) for k in state))
    model.blocks[1] = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    try:
        engine2(**batch(t.rank, 2))
    except RuntimeError as e:
        out["swap"] = str(e)
    engine2.close()  # gathers everything back: the module holds its trained weights
    out["closed"] = tuple(model.emb.weight.shape) == (64, 32) and torch.equal(model.emb.weight, state["emb.weight"])
    return out


def test_reads_outside_forward_and_swapped_modules_are_refused():
    for r in run_world(_misuse, 2, timeout=120):
        # the block's attention reads out_proj's weight, the root the tied embedding
        assert "FunctionalTiedLM" in r["learned"], r["learned"]
        assert any(m.endswith("self_attn") for m in r["learned"]), r["learned"]
        assert "'emb.weight'" in r["read"] and "partitioned" in r["read"] and "GatheredParameters" in r["read"]
        assert r["shape_outside"] == (0,)
        assert r["cpu_noop"] and "'emb.weight'" in r["convert"], r
        assert r["placeholder"] == ((0,), ["zpp: state_dict() (or detach) of partitioned parameters outs"]), r
        assert r["eval"] > 0
        assert "blocks.1.self_attn.in_proj_weight" in r["swap"] and "after initialize" in r["swap"]
        assert r["twice"] == (True, True, True)
        assert r["closed"]


def test_block_detection_and_unit_classes():
    """Default units are the transformer blocks (repeated children, or a Hugging Face
    model's _no_split_modules); zpp.unit_classes names them; an unknown name is an error."""
    from zpp.zero.deepspeed_config import from_deepspeed
    from zpp.zero.planning import block_classes, unit_roots

    model, *_ = models.functional_tied(0)
    assert block_classes(model) == {torch.nn.TransformerEncoderLayer}
    blocks = {id(b) for b in model.blocks} | {id(model.shared)}  # every instance of the class
    assert unit_roots(model, from_deepspeed({})) == blocks
    assert unit_roots(model, from_deepspeed({"zpp": {"unit_classes": ["TransformerEncoderLayer"]}})) == blocks
    assert unit_roots(model, from_deepspeed({"zpp": {"unit_classes": ["Embedding"]}})) == {id(model.emb)}
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert block_classes(mlp) == {torch.nn.Linear}
    with pytest.raises(ValueError, match=r"\['Block'\] match no module.*TransformerEncoderLayer"):
        unit_roots(model, from_deepspeed({"zpp": {"unit_classes": ["Block"]}}))
    gpt, *_ = models.gpt2(0)
    assert {c.__name__ for c in block_classes(gpt)} == {"GPT2Block"}


def _persistent(t):
    """stage3_param_persistence_threshold: parameters under it stay whole (bucketed as at stage 2);
    training still equals DDP; they are never gathered, the others are."""
    ref = _ddp(t, "gpt2")
    out = {}
    for threshold in (0, 1000, 100_000):  # none, biases and norms, everything (DeepSpeed's default)
        model, batch, loss_of = models.MODELS["gpt2"](0)
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        t.counters.reset()
        losses = []
        for step in range(STEPS):
            loss = loss_of(engine(**batch(t.rank, step)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        small = [u for u in engine.units if not u.shards_params]
        for u in engine.units:  # (a sharded parameter's own numel() is 0: read the layout)
            sizes = [slot.numel for slot in u.layout.slots]
            assert (max(sizes) < threshold) if not u.shards_params else (min(sizes) >= threshold), (threshold, u)
        snap = t.counters.snapshot()
        out[threshold] = (_rel(losses, ref), len(small), len(engine.units),
                          snap["all_gather"].logical_bytes if "all_gather" in snap else 0)
        engine.close()
    return out


def test_param_persistence_threshold():
    for r in run_world(_persistent, 2, timeout=200):
        for threshold, (rel, n_small, n_units, _) in r.items():
            assert rel <= RTOL, (threshold, rel)
        assert r[0][1] == 0 and 0 < r[1000][1] < r[1000][2] and r[100_000][1] == r[100_000][2]
        # one all-gather of the small parameters per step instead of two per use
        assert r[100_000][3] < r[1000][3] < r[0][3], r
