"""Data parallelism by replicas: several rollout processes put records into one store at the same time.
Every handle is distinct and every record read back is the one its writer put (its token identity),
never another replica's."""

import os

import torch.multiprocessing as mp

import trace_kernels as tk
from record_factory import captured_builder
from trace_kernels import stores

REPLICAS, PER_REPLICA = 2, 40


def _replica(rank: int, spec: str, out_dir: str):
    store = stores.open_store(spec)
    lines = []
    for i in range(PER_REPLICA):
        b = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(3, 1), seed=i)
        tokens = [rank, i, 7, 8]  # the sample's identity says which replica and request made it
        b.set_identity(token_ids=tokens)
        lines.append(f"{store.put(b.build())} {rank} {i}")
    with open(os.path.join(out_dir, f"replica{rank}.txt"), "w") as f:
        f.write("\n".join(lines))


def test_replicas_writing_one_store_never_collide(tmp_path):
    spec = f"file:{tmp_path / 'store'}"
    mp.start_processes(_replica, args=(spec, str(tmp_path)), nprocs=REPLICAS, join=True, start_method="spawn")
    entries = [line.split() for r in range(REPLICAS) for line in (tmp_path / f"replica{r}.txt").read_text().splitlines()]
    handles = [h for h, _, _ in entries]
    assert len(handles) == len(set(handles)) == REPLICAS * PER_REPLICA
    for h, rank, i in entries:
        rec = stores.get(h, allowed=[spec])
        tk.check_identity(rec, source=h, token_ids=[int(rank), int(i), 7, 8])
    assert stores.open_store(spec).stats()["outstanding"] == 0
