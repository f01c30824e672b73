"""Tensor parallelism 2 on two CPU processes: each rank holds half of every
expert's fc2 input columns and half of the KV heads, and still finds its part of every record row.

Megatron's CPU initialization builds each full weight from the seed and keeps this rank's slice, so the
TP=2 model is the TP=1 model, split. Only float summation order differs (row-parallel all-reduce), so
RTN may flip a rare code; guided rounding must still land on every record code.

The models run forward only, in eval mode: Megatron refuses TP MoE training without sequence
parallelism, and its torch norms refuse sequence parallelism (their weight gradients would need a TP
all-reduce); forward they are exact, so the SP runs build them with that check lifted (test shim).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402
import trace_megatron  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402

FULL = TraceConfig(guidance="full", guided_layers="all")
LENGTHS, SEQ = [16, 13], 16
RUNS = (("alltoall", False), ("allgather", False), ("alltoall", True), ("allgather", True))  # (dispatcher, SP)
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def _worker(rank: int, world: int, port: int, workdir: str):
    import megatron_cpu as mcw

    mcw.init_parallel(rank, world, port, tp=world)
    mcw.allow_torch_norm_with_sequence_parallel()
    import trace_megatron as tm
    from trace_kernels import GuidanceRecord as GR

    data = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=False)
    ids, pos, mask = data["inputs"]
    records = [GR.from_bytes(b) for b in data["records"]]
    layout = tm.TokenLayout.padded(LENGTHS, SEQ)
    results = {}
    for dispatcher, sp in RUNS:
        cfg = mcw.tiny_config(dispatcher=dispatcher, tensor_model_parallel_size=world, sequence_parallel=sp)
        model = mcw.tiny_model(cfg, trace_config=FULL, seed=13).eval()
        fc2 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2
        assert fc2.weight.shape[1] == cfg.moe_ffn_hidden_size // world  # expert fc2 input split over TP
        with torch.no_grad(), tm.guidance(model, records, layout) as batch:
            out = model(ids, pos, mask)
        with torch.no_grad():
            plain = model(ids, pos, mask)  # no guidance: RTN, whole-row amax across the TP shards
        results[(dispatcher, sp)] = {"out": out, "plain": plain, "metrics": batch.metrics()}
    torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_tensor_parallel_two_processes_find_their_slices(tmp_path):
    mc.init_parallel()
    model = mc.tiny_model(mc.tiny_config(), trace_config=FULL, seed=13)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=5)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        single_out = model(ids, pos, mask)
    records = cap.build_records()
    torch.save({"inputs": (ids, pos, mask), "records": [r.to_bytes() for r in records]}, tmp_path / "inputs.pt")
    mp.start_processes(_worker, args=(2, mc.free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    vocab_half = mc.VOCAB // 2
    n = sum(LENGTHS)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for dispatcher, sp in RUNS:
            r = results[(dispatcher, sp)]
            expected = single_out[..., rank * vocab_half : (rank + 1) * vocab_half]  # vocab-parallel logits
            valid = layout.sample.view(SEQ, len(LENGTHS)).t() >= 0
            torch.testing.assert_close(r["out"][valid], expected[valid], rtol=1e-4, atol=1e-4)
            # the single-process run was RTN too; a rare code flip from summation order is tolerated
            close = torch.isclose(r["plain"][valid], expected[valid], rtol=1e-4, atol=1e-4)
            assert close.float().mean() > 0.99, (dispatcher, sp)
            m = r["metrics"]
            for site in SITES:
                assert m[f"trace/all/{site}/mismatch_guided"] == 0, (rank, dispatcher, sp, site)
                assert m[f"trace/all/{site}/mismatch_rtn"] < 1e-3, (rank, dispatcher, sp, site)
            # attention and experts see all tokens of the TP group: every row is guided on every rank
            assert m["trace/all/k/guided_rows"] == n * 2
            # linear_fc2's K is split over the ranks: its partial sums cannot be the engine's exact GEMM,
            # so it runs Megatron's BF16 path, counted; linear_fc1 (output columns split) stays exact
            fc2_rows = m["trace/all/moe_fc2_in/guided_rows"] + m["trace/all/moe_fc2_in/fallback_rows"]
            assert m["trace/all/moe_fc2_in/expert_gemm_bf16"] == fc2_rows > 0
            assert m["trace/all/moe_fc1_in/expert_gemm_bf16"] == 0
            # expert rows: (token, routed expert) pairs; without SP every TP rank feeds the same tokens in,
            # so an expert computes each pair once per TP rank
            assert m["trace/all/moe_fc1_in/guided_rows"] == n * 2 * 2 * (1 if sp else 2), (dispatcher, sp)
