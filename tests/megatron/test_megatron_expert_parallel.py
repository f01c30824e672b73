"""Expert parallelism 2 on two CPU processes (gloo) computes the same codes as one process.

Each rank holds its own sample and its record (as data-parallel ranks do); half of the experts live on
each rank, so the alltoall / allgather dispatchers send tokens — and their guide rows — across ranks.
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
DISPATCHERS = ("alltoall", "allgather")
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def _worker(rank: int, world: int, port: int, workdir: str):
    import megatron_cpu as mcw

    mcw.init_parallel(rank, world, port, ep=world)
    import trace_megatron as tm
    from trace_kernels import GuidanceRecord as GR

    data = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=False)
    results = {}
    for dispatcher in DISPATCHERS:
        model = mcw.tiny_model(mcw.tiny_config(dispatcher=dispatcher), trace_config=FULL, seed=11)
        mcw.load_full_state(model, data["state"], ep_rank=rank, ep_size=world)
        ids, pos, mask = data["inputs"]
        layout = tm.TokenLayout.padded([LENGTHS[rank]], SEQ)
        record = GR.from_bytes(data["records"][rank])
        with torch.no_grad(), tm.guidance(model, [record], layout) as batch:
            out = model(ids[rank : rank + 1], pos[rank : rank + 1], mask)
        results[dispatcher] = {"out": out, "metrics": batch.metrics(group=torch.distributed.group.WORLD)}
    torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_expert_parallel_two_processes_same_codes_as_one(tmp_path):
    mc.init_parallel()  # here, not at import: the spawned workers import this module too
    model = mc.tiny_model(mc.tiny_config(), trace_config=FULL, seed=11)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=4)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:  # one process, RTN
        single_out = model(ids, pos, mask)
    records = cap.build_records()
    torch.save(
        {"state": model.state_dict(), "inputs": (ids, pos, mask), "records": [r.to_bytes() for r in records]},
        tmp_path / "inputs.pt",
    )
    mp.start_processes(_worker, args=(2, mc.free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for dispatcher in DISPATCHERS:
            r = results[dispatcher]
            torch.testing.assert_close(r["out"][0, : LENGTHS[rank]], single_out[rank, : LENGTHS[rank]], rtol=0, atol=0)
            m = r["metrics"]  # summed over both ranks
            n = sum(LENGTHS)
            for site in SITES:
                assert m[f"trace/all/{site}/mismatch_rtn"] == 0, (dispatcher, site)  # same RTN codes as one process
                assert m[f"trace/all/{site}/mismatch_guided"] == 0, (dispatcher, site)
                rows = n * 2 * (2 if site.startswith("moe") else 1)
                assert m[f"trace/all/{site}/guided_rows"] == rows, (dispatcher, site)
