"""Context parallelism 2 on two CPU processes (gloo) trains on the same codes as one process.

Megatron-Core's local core attention refuses CP and Transformer Engine is not installed, so the trace
spec's core attention all-gathers K/V over the CP group (trace_megatron/context_parallel.py). Each rank
feeds Megatron's load-balanced shard of the sequence (chunks r and 3 - r of 4) with the guidance layout
`TokenLayout.context_parallel_shard`, and runs forward and backward; the sum of the ranks' weight
gradients is the CP=1 gradient (each rank's loss covers its own tokens).

fp32, so what is left is summation order: keys arrive in rank order, not sequence order, and the weight
gradients are sums of two partial sums. Measured here (fp32 eps 1.2e-7): logits within 3.3e-7 of CP=1
(|logit| up to 1.5), grads within 5e-7 of CP=1 relative to each tensor's largest entry: a few ulps, as
reordered sums give; the bounds below are 10x that.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402
import trace_megatron  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402
from trace_megatron.layout import cp_chunk_index  # noqa: E402

FULL = TraceConfig(guidance="full", guided_layers="all")
LENGTHS, SEQ, CP = [16, 11], 16, 2
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def _step(model, records, layout, ids, pos, mask, weights):
    """Guided forward and backward of sum(logits * weights); (logits, metrics, grads by name)."""
    model.zero_grad(set_to_none=True)
    with trace_megatron.guidance(model, records, layout) as batch:
        logits = model(ids, pos, mask)
        (logits * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), batch.metrics(), grads


def _packed(ids):
    """The batch packed THD-style: each sample padded to a multiple of 2 * CP (Megatron's CP packing)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    spans = [-(-n // (2 * CP)) * 2 * CP for n in LENGTHS]
    cu = torch.tensor([0] + spans).cumsum(0).to(torch.int32)
    packed = torch.zeros(1, int(cu[-1]), dtype=torch.int64)
    for b, n in enumerate(LENGTHS):
        packed[0, cu[b] : cu[b] + n] = ids[b, :n]
    cu_real = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=max(spans), max_seqlen_kv=max(spans))
    return packed, psp, trace_megatron.TokenLayout.packed(cu, lengths=LENGTHS)


def _worker(rank: int, world: int, port: int, workdir: str):
    import megatron_cpu as mcw

    mcw.init_parallel(rank, world, port, cp=world)
    import trace_megatron as tm
    from trace_kernels import GuidanceRecord as GR

    data = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=False)
    ids, pos, mask = data["inputs"]
    records = [GR.from_bytes(b) for b in data["records"]]
    model = mcw.tiny_model(mcw.tiny_config(context_parallel_size=world), trace_config=FULL, seed=13)
    model.load_state_dict(data["state"], strict=False)
    idx = cp_chunk_index(SEQ, world, rank)  # what Megatron's get_batch_on_this_cp_rank keeps
    layout = tm.TokenLayout.padded(LENGTHS, SEQ).context_parallel_shard(world, rank)
    logits, metrics, grads = _step(model, records, layout, ids[:, idx], pos[:, idx], mask, data["weights"][:, idx])
    # Control: guidance rows in plain contiguous order (positions rank*8 .. rank*8+7) are the wrong rows
    # for what this rank holds, and guided rounding cannot reach their codes.
    full, half = tm.TokenLayout.padded(LENGTHS, SEQ), SEQ // world
    grid = lambda t: t.view(SEQ, len(LENGTHS))[rank * half : (rank + 1) * half].reshape(-1)  # noqa: E731
    naive = tm.TokenLayout(grid(full.sample), grid(full.token), half, len(LENGTHS), tuple(LENGTHS))
    with torch.no_grad(), tm.guidance(model, records, naive) as wrong:
        model(ids[:, idx], pos[:, idx], mask)
    # Packed (THD) micro-batch, the way verl feeds Megatron: per sample chunks r and 3 - r.
    packed, psp, playout = _packed(ids)
    from trace_megatron.context_parallel import cp_global_index

    pidx = cp_global_index(packed.shape[1] // world, world, rank, psp.cu_seqlens_q_padded)
    with torch.no_grad(), tm.guidance(model, records, playout.context_parallel_shard(world, rank, psp.cu_seqlens_q_padded)) as pb:
        plogits = model(packed[:, pidx], torch.zeros_like(packed[:, pidx]), None, packed_seq_params=psp)
    torch.save({"logits": logits, "metrics": metrics, "grads": grads, "naive": wrong.metrics(),
                "packed": plogits, "packed_index": pidx, "packed_metrics": pb.metrics()},
               os.path.join(workdir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_context_parallel_two_processes_same_codes_logits_and_grads_as_one(tmp_path):
    mc.init_parallel()
    model = mc.tiny_model(mc.tiny_config(), trace_config=FULL, seed=13)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=5)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(ids, pos, mask)
    records = cap.build_records()
    valid = layout.sample.view(SEQ, len(LENGTHS)).t() >= 0  # [B, S]
    weights = torch.randn(len(LENGTHS), SEQ, mc.VOCAB, generator=torch.Generator().manual_seed(3)) * valid[..., None]
    logits1, metrics1, grads1 = _step(model, records, layout, ids, pos, mask, weights)
    packed, psp, playout = _packed(ids)
    with torch.no_grad(), trace_megatron.guidance(model, records, playout):
        packed1 = model(packed, torch.zeros_like(packed), None, packed_seq_params=psp)
    torch.save({"state": model.state_dict(), "inputs": (ids, pos, mask), "weights": weights,
                "records": [r.to_bytes() for r in records]}, tmp_path / "inputs.pt")
    mp.start_processes(_worker, args=(CP, mc.free_port(), str(tmp_path)), nprocs=CP, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(CP)]

    for rank, r in enumerate(ranks):
        idx = cp_chunk_index(SEQ, CP, rank)
        m, held = r["metrics"], int(valid[:, idx].sum())
        for site in SITES:
            assert m[f"trace/all/{site}/mismatch_guided"] == 0, (rank, site)  # the CP=1 run's codes, all of them
        assert m["trace/all/k/guided_rows"] == held * 2  # each of its tokens, in each of the 2 layers
        assert sum(r["naive"][f"trace/all/{s}/mismatch_guided"] for s in SITES) > 0, rank  # the order matters
        err = (r["logits"] - logits1[:, idx]).abs()[valid[:, idx]].max()
        print(f"\nCP rank {rank}: max |logit CP=2 - CP=1| {err:.2e} (|logit| max {logits1.abs().max():.2f})")
        assert err < 5e-6
        for site in SITES:
            assert r["packed_metrics"][f"trace/all/{site}/mismatch_guided"] == 0, ("packed", rank, site)
        real = playout.sample[r["packed_index"]] >= 0
        perr = (r["packed"][0] - packed1[0, r["packed_index"]]).abs()[real].max()
        print(f"CP rank {rank} packed: max |logit CP=2 - CP=1| {perr:.2e}")
        assert perr < 5e-6
    assert metrics1["trace/all/k/mismatch_guided"] == 0
    assert ranks[0]["grads"].keys() == grads1.keys()
    worst = 0.0
    for name, g1 in grads1.items():
        g2 = ranks[0]["grads"][name] + ranks[1]["grads"][name]
        rel = float((g2 - g1).abs().max() / g1.abs().max().clamp(min=1e-12))
        worst = max(worst, rel)
        assert rel < 5e-6, name
    print(f"grads: max |sum of CP ranks - CP=1| / max |CP=1| over tensors {worst:.2e}")
