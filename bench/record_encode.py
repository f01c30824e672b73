"""The engine's record cost per request, as vLLM's capture store holds the rows: the embedded tiny
model's shape (4 layers x 4 sites), --requests requests sharing each forward step (a prefill of
--prompt tokens, then one row per decode step), each request's chunks naming its rows of the step
(StepRows). Per record, process CPU time, best of --repeats, eager (torch encoder) beside native (the
numba encoder, TRACE_FP4_RECORD_BACKEND=native), checked byte-identical in the run:

  encode      the sparse payloads of the record's 16 sites (the encoder alone, rows already joined)
  assemble    assemble_record of every request in one take (one ChunkJoiner): join the chunks,
              encode, audit, routing; per record
  to_bytes    the record's safetensors bytes with its checksums
  from_bytes  read back and verified (what get_records does with the worker's bytes)

    .venv/bin/python bench/record_encode.py [--requests 16 --prompt 6 --tokens 64] [--repeats 10] [--json FILE]
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from record_factory import SHAPE  # noqa: E402

import trace_kernels as tk  # noqa: E402
from trace_kernels.engine import assemble_record  # noqa: E402
from trace_kernels.engine.captured_rows import ChunkJoiner, StepRows, join_chunks  # noqa: E402
from trace_kernels.guides.sparse.fused_encode import encode_payload  # noqa: E402
from trace_kernels.guides.sparse.rates import layer_rates  # noqa: E402
from store_requests import random_steps, worker_of  # noqa: E402
from store_requests import run_steps as store_steps  # noqa: E402


def captured_requests(requests: int, prompt: int, tokens: int, seed: int = 0):
    """Every request's chunks (routing StepRows, sites StepRows) in token order, as end_step leaves them."""
    g = torch.Generator().manual_seed(seed)
    chunks = [[] for _ in range(requests)]
    for n in [prompt] + [1] * tokens:
        T = n * requests
        sites, routing = {}, {}
        for layer in range(SHAPE.num_layers):
            routing[layer] = torch.randint(0, SHAPE.num_experts, (T, SHAPE.top_k), generator=g).to(torch.int16)
            for site in SHAPE.layer_sites(layer):
                x = torch.randn(T, *SHAPE.row_shape(site), generator=g)
                sites[(layer, site)] = tk.quantize(x, tk.row_amax(x))
        sb, rb = StepRows.row_bytes(sites), StepRows.row_bytes(routing)
        for i in range(requests):
            chunks[i].append((StepRows(routing, i * n, (i + 1) * n, rb), StepRows(sites, i * n, (i + 1) * n, sb)))
    return chunks


def best_per_record(fn, items, repeats):
    """Best process CPU time over `repeats` passes of fn over every item, per item."""
    ts = []
    for _ in range(repeats):
        t = time.process_time()
        for it in items:
            fn(it)
        ts.append((time.process_time() - t) / len(items))
    return min(ts)


def with_backend(backend, fn):
    def run(item):
        os.environ["TRACE_FP4_RECORD_BACKEND"] = backend
        try:
            return fn(item)
        finally:
            os.environ.pop("TRACE_FP4_RECORD_BACKEND")
    return run


def store_figures(args, config) -> dict:
    """The same requests through vLLM's capture store (trace_vllm_plugin.capture.CaptureStore, no
    engine): the rows each decode step's forward writes (`put`, pre-quantized here) and `end_step`,
    per step; then every record taken by the worker's `trace_fp4_take_records` (one take of all)."""
    from trace_vllm_plugin.capture import CaptureStore
    from trace_vllm_plugin.worker_rpc import trace_fp4_take_records

    R = args.requests
    ids = [f"r{i}" for i in range(R)]
    steps = random_steps(SHAPE, R, args.prompt, args.tokens)

    def run_steps(store):
        return min(store_steps(store, ids, steps)[1:])  # a decode step

    def take_all(store, backend):
        os.environ["TRACE_FP4_RECORD_BACKEND"] = backend
        try:
            for r in ids:
                store.finish(r)
            t = time.process_time()
            out = trace_fp4_take_records(worker_of(store), ids)  # the worker's RPC, as get_records runs it
            took = (time.process_time() - t) / R
            assert all("record" in v for v in out.values()), out
            return took
        finally:
            os.environ.pop("TRACE_FP4_RECORD_BACKEND")

    best: dict = {}
    for _ in range(args.repeats):
        for backend in ("eager", "native"):
            store = CaptureStore(SHAPE, config, capacity=args.prompt * R)
            step = run_steps(store)
            take = take_all(store, backend)
            best["store_step_s"] = min(best.get("store_step_s", step), step)
            key = f"store_take_{backend}_s"
            best[key] = min(best.get(key, take), take)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "record_encode")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = tk.TraceConfig()  # sparse at every layer, with the audit: the engine's default
    requests = captured_requests(args.requests, args.prompt, args.tokens)
    T = args.prompt + args.tokens

    def build(chunks, joiner=None):
        return assemble_record(SHAPE, config, chunks, joiner=joiner)

    def build_all(_):
        joiner = ChunkJoiner()  # as one take of every request: their shared steps are joined once
        for c in requests:
            joiner.expect(r for r, _ in c)
            joiner.expect(s for _, s in c)
        return [build(c, joiner) for c in requests]

    joined = [join_chunks(s for _, s in chunks) for chunks in requests]
    sites = [[(q, site, layer_rates(config, layer, site, q.shape[-1])) for (layer, site), q in j.items()] for j in joined]

    def encode(backend):
        return lambda rows: [encode_payload(q, site, rates, backend=backend) for q, site, rates in rows]

    # byte-identical in this run (and the numba kernel compiled or loaded before the clock starts)
    assert all(torch.equal(a, b) for rows in sites for a, b in zip(encode("torch")(rows), encode("native")(rows)))
    records = [build(c) for c in requests]
    assert all(with_backend("native", build)(c).to_bytes() == r.to_bytes() for c, r in zip(requests, records))
    blobs = [r.to_bytes() for r in records]
    f = {
        "encode_eager_s": best_per_record(encode("torch"), sites, args.repeats),
        "encode_native_s": best_per_record(encode("native"), sites, args.repeats),
        "assemble_eager_s": best_per_record(with_backend("eager", build_all), [None], args.repeats) / len(requests),
        "assemble_native_s": best_per_record(with_backend("native", build_all), [None], args.repeats) / len(requests),
        "to_bytes_s": best_per_record(lambda r: r.to_bytes(), records, args.repeats),
        "from_bytes_s": best_per_record(tk.GuidanceRecord.from_bytes, blobs, args.repeats),
    }
    print(f"{args.requests} requests x {T}-token records ({args.prompt} prompt + {args.tokens} decode steps), "
          f"{SHAPE.num_layers} layers x 4 sites, sparse + audit, 1 thread; ms per record, best of {args.repeats}:")
    for k, v in f.items():
        print(f"  {k:<20} {v * 1e3:8.3f}")
    print(f"  encode native / eager: {f['encode_native_s'] / f['encode_eager_s']:.3f}x; "
          f"assemble native / eager: {f['assemble_native_s'] / f['assemble_eager_s']:.3f}x")
    store = store_figures(args, config)
    f.update(store)
    print(f"  vLLM capture store, {args.requests} requests: per decode step (puts + end_step) "
          f"{store['store_step_s'] * 1e3:.3f} ms; per record taken (take, build, to_bytes), eager "
          f"{store['store_take_eager_s'] * 1e3:.3f} ms, native {store['store_take_native_s'] * 1e3:.3f} ms")
    write_results(args.json, "record_encode", {"requests": args.requests, "tokens_per_record": T, "repeats": args.repeats,
                                               "ms_per_record": {k[:-2]: v * 1e3 for k, v in f.items()}, **f})


if __name__ == "__main__":
    main()
