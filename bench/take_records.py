"""The vLLM worker's take alone, no engine: what `get_records` costs per take of --requests records, and
the SHA-256 over the take's record bytes (the check that a change to the take keeps every byte).

The requests as vLLM's capture store holds them (bench/record_encode.py's `store_figures` shape: the
embedded tiny model, --requests requests sharing a prefill of --prompt tokens then --tokens decode
steps, rows pre-quantized and `put` step by step), every one taken by `trace_fp4_take_records` with a
token digest per request, then read back with `GuidanceRecord.from_bytes` (the driver's verification).
Process CPU, best of --repeats after one warm-up take (which loads the native encoder's kernel).

    .venv/bin/python bench/take_records.py [--requests 16 --prompt 6 --tokens 64] [--repeats 8] [--backend native]

Prints the take and the read-back in ms per take, and the SHA-256; with the defaults, torch 2.13 and
the sparse default config the SHA-256 was 818c9211caeaa59f7b480aba2751b1b9d88546f7a951f56b72ac2c52ded1fe71
before and after lane take3's batched take (docs/measurements.md). Writes nothing.
"""

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from record_factory import SHAPE  # noqa: E402

import trace_kernels as tk  # noqa: E402
from store_requests import random_steps, run_steps, worker_of  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--backend", default="native", help="TRACE_FP4_RECORD_BACKEND (native or eager)")
    args = ap.parse_args()
    os.environ["TRACE_FP4_RECORD_BACKEND"] = args.backend
    torch.set_num_threads(1)
    from trace_vllm_plugin.capture import CaptureStore
    from trace_vllm_plugin.worker_rpc import trace_fp4_take_records

    R, P = args.requests, args.prompt
    config = tk.TraceConfig()
    ids = [f"r{i}" for i in range(R)]
    idents = [{"token_digest": f"{j:064x}", "num_prompt_tokens": P} for j in range(R)]
    steps = random_steps(SHAPE, R, P, args.tokens)

    def filled():
        store = CaptureStore(SHAPE, config, capacity=P * R)
        run_steps(store, ids, steps)
        for r in ids:
            store.finish(r)
        return worker_of(store)

    takes, reads, digest = [], [], None
    for _ in range(args.repeats + 1):  # the first is the warm-up
        wrapper = filled()
        t = time.process_time()
        out = trace_fp4_take_records(wrapper, ids, identities=idents)
        takes.append(time.process_time() - t)
        blobs = [out[r]["record"] for r in ids]
        t = time.process_time()
        for b in blobs:
            tk.GuidanceRecord.from_bytes(b)
        reads.append(time.process_time() - t)
        digest = hashlib.sha256(b"".join(blobs)).hexdigest()
    print(f"{R} records of {P + args.tokens} tokens, {args.backend} encoder, best of {args.repeats}: take "
          f"{min(takes[1:]) * 1e3:.1f} ms, from_bytes {min(reads[1:]) * 1e3:.1f} ms per take; sha256 {digest}")


if __name__ == "__main__":
    main()
