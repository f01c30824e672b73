"""vLLM's AsyncLLM (the engine behind the OpenAI server and verl/slime rollout servers): concurrent
streams get their own records, and a request aborted mid-flight leaves nothing behind."""

import asyncio

import trace_vllm_plugin as tvp
from vllm_helpers import KV_BYTES, PROMPTS, greedy, tiny_moe


async def _run():
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(tiny_moe()), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=KV_BYTES,
        max_model_len=512, quantization="trace_fp4", seed=0,
    )
    engine = AsyncLLM.from_engine_args(args)
    try:
        async def generate(request_id, prompt, params):
            final = None
            async for out in engine.generate(prompt, params, request_id=request_id):
                final = out
            return final

        outs = await asyncio.gather(*[generate(f"r{i}", p, greedy(3 + 2 * i)) for i, p in enumerate(PROMPTS)])
        records = await tvp.get_records_async(engine, outs)

        async for out in engine.generate(PROMPTS[0], greedy(200), request_id="to-abort"):
            if len(out.outputs[0].token_ids) >= 3:
                await engine.abort("to-abort")
                break
        last = await generate("last", PROMPTS[1], greedy(2))  # a step after the abort
        await tvp.get_records_async(engine, [last])
        stats = (await engine.collective_rpc("trace_fp4_stats"))[0]
    finally:
        engine.shutdown()
    return outs, records, stats


def test_async_engine_records_and_abort():
    outs, records, stats = asyncio.run(_run())
    for out, rec in zip(outs, records):
        assert rec.num_tokens == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    assert stats["counters"]["aborted_records_dropped"] == 1
    assert stats["live_requests"] == 0 and stats["done_requests"] == 0 and stats["capture_bytes"] == 0
