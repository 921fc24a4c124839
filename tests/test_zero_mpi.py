"""The engine on the MPI transport (mpiexec), against the same runs on the torch transport:
stage 1, and stage 3 with all of ZeRO++ (qwZ, hpZ, qgZ), also with weight deltas, and prefetch
on 2 nodes x 2 ranks.
Losses agree, wire bytes per step are the same (the counters follow one model for every
backend), and prefetch runs on MPI's non-blocking all-gather."""
import pytest
import torch

import zpp.zero as zz
from tests.dist import needs_mpi, run_world
from tests.gpt import GPT, GPTConfig

pytestmark = needs_mpi
STEPS = 5
ZEROPP = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
RUNS = {"stage1": {"stage": 1}, "stage3": {"stage": 3}, "zeropp": ZEROPP, "zeropp-delta4": ZEROPP}
ZPP = {"zeropp-delta4": {"weight_delta_bits": 4}}  # the node copy refreshed by int4 weight deltas


def _engine_world(t):
    out = {}
    g = torch.Generator().manual_seed(900 + t.rank)
    batches = [(x, x.roll(-1, 1)) for x in (torch.randint(0, 128, (4, 16), generator=g) for _ in range(STEPS))]
    for name, zero in RUNS.items():
        torch.manual_seed(11)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
               "gradient_clipping": 1.0, "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0},
               "zpp": ZPP.get(name, {})}
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        losses, wire = [], []
        for x, y in batches:
            t.counters.reset()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            wire.append({k: (v.calls, v.intra_bytes, v.inter_bytes) for k, v in t.counters.snapshot().items()})
        out[name] = dict(losses=losses, wire=wire, stats=engine.prefetch_stats, transport=t.name)
        engine.close()
    return out


@pytest.mark.slow  # 16 s; tests/test_zero_overlap.py keeps an MPI engine in the quick lane
@pytest.mark.timeout(630)  # two worlds of up to 300 s each
def test_engine_on_mpi_matches_torch():
    mpi = run_world(_engine_world, 4, backend="mpi", ranks_per_node=2, timeout=300)
    ref = run_world(_engine_world, 4, backend="torch", ranks_per_node=2, timeout=300)
    for rank in range(4):
        for name in RUNS:
            a, b = mpi[rank][name], ref[rank][name]
            assert a["transport"] == "mpi" and b["transport"] == "torch"
            rel = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"], strict=True))
            # MPI and gloo sum the gradients in different orders (reduce-scatter, norm)
            assert rel <= 1e-5, (rank, name, rel, a["losses"], b["losses"])
            assert a["wire"] == b["wire"], (rank, name)
            if name != "stage1":
                s = a["stats"]
                assert s.prefetched > 0 and s.hits == s.prefetched and s.synchronous == 0, (name, s)
                assert s.mismatches == 0 and s.dropped == 0, (name, s)
        assert mpi[rank]["zeropp"]["stats"].passes == STEPS
        # the deltas' refresh crossed the node link on MPI too (int4 codes, over the inter-node group)
        assert all(w["quantized_all_gather"][2] > 0 for w in mpi[rank]["zeropp-delta4"]["wire"][1:])
    print({name: (mpi[0][name]["losses"], ref[0][name]["losses"]) for name in RUNS})
