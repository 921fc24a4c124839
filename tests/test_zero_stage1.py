"""Stage 1 moves DDP's bytes: a reduce-scatter of the gradients and an all-gather of the
updated parameters instead of an all-reduce and an all-gather (see [Note: stage 1 bytes] in
:mod:`zpp.zero.unit`). Wire bytes from the transport's counters, losses against torch DDP,
on 2 ranks and on 2 nodes x 2 ranks, with and without gradient accumulation."""
import pytest

from tests.dist import run_world
from tests.test_zero_engine import _batches, _config, _ddp_losses, _rel, _zpp_losses
from zpp.zero.shard import SHARD_ALIGN

STEPS = 6


def _run(t, stage, batches, gas=1):
    losses, engine = _zpp_losses(t, "gpt", batches, _config(stage, gas=gas))
    snap = t.counters.snapshot()
    steps = len(batches) // gas
    per_step = {op: (s.calls / steps, s.wire_bytes / steps, s.inter_bytes / steps) for op, s in snap.items()}
    units = len(engine.units)
    engine.close()
    return losses, per_step, units


def _world(t):
    out = {}
    batches = _batches("gpt", t.rank, STEPS)
    ref, _ = _ddp_losses(t, "gpt", batches)
    for stage in (0, 1):
        losses, per_step, units = _run(t, stage, batches)
        out[stage] = dict(rel=_rel(losses, ref), wire=per_step, units=units)
    # accumulation: 2 micro-steps per optimizer step, still one reduction per step
    micro = [(x[i:i + 2], y[i:i + 2]) for x, y in batches for i in (0, 2)]
    _, per_step, _ = _run(t, 1, micro, gas=2)
    out["accum"] = dict(wire=per_step)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,rpn", [(2, None), (4, 2)], ids=["2ranks", "2x2"])
def test_stage1_moves_ddp_bytes(world, rpn):
    results = run_world(_world, world, ranks_per_node=rpn, timeout=180)
    for rank, res in enumerate(results):
        s0, s1 = res[0], res[1]
        assert s0["rel"] <= 1e-5 and s1["rel"] <= 1e-5, (rank, s0["rel"], s1["rel"])
        # stage 0: one all-reduce per unit; stage 1: one reduce-scatter and one all-gather per unit
        assert set(s0["wire"]) == {"all_reduce"}, s0["wire"]
        # plus one fp64 scalar all-reduce per step: the global gradient norm of the shards
        norm = s1["wire"].pop("all_reduce")
        assert norm[0] == 1 and norm[1] == 2 * 8 * (world - 1) / world, norm
        assert set(s1["wire"]) == {"reduce_scatter", "all_gather"}, s1["wire"]
        assert s1["wire"]["reduce_scatter"][0] == s1["wire"]["all_gather"][0] == s1["units"]
        ddp = s0["wire"]["all_reduce"][1]
        got = s1["wire"]["reduce_scatter"][1] + s1["wire"]["all_gather"][1]
        # shards pad each unit to SHARD_ALIGN * world elements (stage 0 to SHARD_ALIGN):
        # at most 2 * (W - 1) / W * SHARD_ALIGN * W fp32 elements more per unit and step
        slack = s1["units"] * 2 * (world - 1) * SHARD_ALIGN * 4
        assert ddp <= got <= ddp + slack, (rank, ddp, got, slack)
        if rpn:
            assert s1["wire"]["reduce_scatter"][2] + s1["wire"]["all_gather"][2] <= \
                s0["wire"]["all_reduce"][2] + slack
        # with accumulation the bytes per optimizer step are the same as without
        res["accum"]["wire"].pop("all_reduce")
        assert res["accum"]["wire"] == s1["wire"], (res["accum"]["wire"], s1["wire"])
    print({k: v for k, v in results[0].items()})
