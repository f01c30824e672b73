"""trace_fp4 under vLLM's torch.compile (enforce_eager=False): the expert computation is one opaque
custom op and the KV write goes through vLLM's opaque cache-update op, so compilation works and
records keep one row per token, read from the static capture buffers the compiled forward writes (the
ones a CUDA graph replays). Compiled and eager records are not compared here: on the CPU build the
compiled model's BF16 ops around the experts round differently (inductor fusions, native custom ops),
so the tokens differ; bench/gpu_check.py compares graph replay with the same compiled model without
graphs. (About a minute of compilation on a 2-core machine.)"""

import torch

import trace_vllm_plugin as tvp
from vllm_helpers import FULL_ALL, PROMPTS, greedy, make_llm, shutdown, tiny_moe


def test_compiled_engine_captures_per_request():
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, enforce_eager=False)
    try:
        params = [greedy(6), greedy(3), greedy(9)]
        batched = llm.generate(PROMPTS, params)
        records = tvp.get_records(llm, batched)
        for out, rec in zip(batched, records):
            assert rec.num_tokens == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        solo = tvp.get_record(llm, llm.generate(PROMPTS[1:2], params[1])[0])
        for name, t in records[1].tensors.items():
            assert torch.equal(t, solo.tensors[name]), name
        counters = tvp.stats(llm)["counters"]
        assert counters["moe_calls.layer3"] >= counters["steps"] and counters["kv_calls.layer3"] == counters["steps"]
        # Every compiled step's rows came from the static capture buffers (no eager fallback, no gap).
        assert counters.get("capture_buffer_overflow_steps", 0) == 0 and counters.get("steps_missing_capture", 0) == 0
        assert counters["captured_rows"] == sum(r.num_tokens for r in records) + solo.num_tokens
    finally:
        shutdown(llm)
