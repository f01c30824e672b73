"""Guidance records moved per verl step, and the time each trainer rank takes to resolve its own.

    .venv/bin/python bench/verl_records.py [--samples 32] [--tokens 128] [--layers 8] [--dp 2] [--stores file,ray]

Records: compact default (mantissa bit + scales, deeper half of the layers) for a Qwen3-30B-A3B-shaped
layer (hidden 2048, MoE 768, top-8, 128 experts, 4 KV heads x 128), `--layers` layers, random captured
values, one record per sample of `--tokens` rows. They are put in the store as the rollout server does,
their handles ride a verl batch (`non_tensor_batch`), the batch is split over `--dp` data-parallel ranks
(verl's dispatch chunks it) and each rank's share through `prepare_micro_batches` (dynamic batch
sizing); then each rank's `trace_verl` record cache resolves its micro-batches, timed per rank. Ranks
run one after the other in this process (a CPU machine), so "per rank" is what one rank would take.
"""

import argparse
import tempfile
import time

import numpy as np
import torch

import trace_kernels as tk
from trace_kernels import stores
from trace_kernels.config import SITES

SHAPE30B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8, num_kv_heads=4, head_dim=128)


def make_record(shape, config, T, seed):
    g = torch.Generator().manual_seed(seed)
    b = tk.RecordBuilder(shape, config)
    modes = config.layer_modes(shape.num_layers)
    for layer in range(shape.num_layers):
        b.add_routing(layer, torch.randint(0, shape.num_experts, (T, shape.top_k), generator=g))
        if modes[layer] is None:
            continue
        for site in SITES:
            x = torch.randn(T, *shape.row_shape(site), generator=g)
            b.add(layer, site, tk.quantize(x, tk.row_amax(x)))
    ids = torch.randint(1, 1000, (T + 1,), generator=g)
    b.set_identity(token_ids=ids[:T].tolist())
    return b.build(), ids


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stores", default="file,ray")
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "verl_records")
    args = ap.parse_args(argv)

    from tensordict import NonTensorStack
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from trace_verl.records import RecordCache

    shape = tk.ModelShape(num_layers=args.layers, **SHAPE30B)
    config = tk.PAPER_CONFIG  # compact, deeper half: the paper's default
    t0 = time.perf_counter()
    made = [make_record(shape, config, args.tokens - (i % 7), seed=i) for i in range(args.samples)]
    print(f"built {len(made)} records in {time.perf_counter() - t0:.1f} s")
    total_bytes = sum(r.nbytes for r, _ in made)
    tokens = sum(r.num_tokens for r, _ in made)
    rows = []
    for kind in args.stores.split(","):
        if kind == "ray":
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            store = stores.open_store("ray:trace_fp4_bench")
        else:
            store = stores.open_store(f"file:{tempfile.mkdtemp(prefix='trace_verl_bench_')}")
        t0 = time.perf_counter()
        handles = [store.put(r) for r, _ in made]
        put_s = time.perf_counter() - t0
        ids = [i for _, i in made]
        td = tu.get_tensordict({"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged)},
                               non_tensor_dict={})
        td.set("trace_fp4_handle", NonTensorStack(*handles))
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=4 * args.tokens)
        per_rank = []
        chunk = args.samples // args.dp
        for rank in range(args.dp):
            share = td[rank * chunk : (rank + 1) * chunk]
            micro, _ = prepare_micro_batches(share, dp_group=None)
            cache = RecordCache(owner=True)
            t0 = time.perf_counter()
            nbytes = 0
            for mb in micro:
                from trace_verl.records import handles_of

                _, info = cache.resolve(handles_of(mb))
                nbytes += info["resolved_bytes"]
            per_rank.append((time.perf_counter() - t0, nbytes, len(micro)))
            cache.end_step()  # deletes this rank's records, as at the next step's first forward
        rows.append((kind, put_s, per_rank, store.stats()))
        if kind == "ray":
            ray.shutdown()
    print(f"\n{args.samples} samples x ~{args.tokens} tokens, {args.layers} layers Qwen3-30B-A3B-shaped, compact "
          f"default: {total_bytes / 1e6:.1f} MB per step ({total_bytes / tokens / 1e3:.1f} KB/token), dp={args.dp}")
    print("| store | put, all records | resolve per rank (its share) | rank throughput | micro-batches per rank |")
    print("| --- | --- | --- | --- | --- |")
    for kind, put_s, per_rank, st in rows:
        sec = np.mean([p[0] for p in per_rank])
        mb = np.mean([p[1] for p in per_rank]) / 1e6
        print(f"| {kind} | {put_s * 1e3:.0f} ms | {sec * 1e3:.0f} ms for {mb:.1f} MB | {mb / sec:.0f} MB/s | "
              f"{np.mean([p[2] for p in per_rank]):.0f} |")
        print(f"  store stats after the step: {st}")
    write_results(args.json, "verl_records", {
        "samples": args.samples, "tokens": args.tokens, "layers": args.layers, "dp": args.dp,
        "bytes_per_step": total_bytes, "tokens_per_step": tokens,
        "stores": [{"store": kind, "put_ms": put_s * 1e3,
                    "resolve_ms_per_rank": float(np.mean([p[0] for p in per_rank])) * 1e3,
                    "resolved_bytes_per_rank": float(np.mean([p[1] for p in per_rank])),
                    "micro_batches_per_rank": float(np.mean([p[2] for p in per_rank]))}
                   for kind, put_s, per_rank, st in rows],
    })


if __name__ == "__main__":
    main()
