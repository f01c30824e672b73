"""trace_fp4 in real vLLM (CPU, in-process engine): it runs, it changes outputs plausibly, and the
records hold exactly the codes of the engine's own expert inputs and K/V, per request."""

import pytest
import torch

import trace_vllm_plugin as tvp
from vllm_helpers import FULL_ALL, PROMPTS, assert_records_hold_the_engines_codes, greedy, make_llm, shutdown, tiny_moe

TEXT = "Reinforcement learning for language models alternates between generating rollouts and training"
NUM_LAYERS = 4


def _prompt_logprobs(llm) -> torch.Tensor:
    from vllm import SamplingParams

    out = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]), out


@pytest.fixture(scope="module")
def bf16_logprobs():
    llm = make_llm(tiny_moe())
    try:
        yield _prompt_logprobs(llm)[0]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def llm(bf16_logprobs):
    # A small token budget per step: long prompts are prefilled in chunks, next to decodes.
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, max_num_batched_tokens=32)
    yield llm
    shutdown(llm)


def test_runs_on_every_moe_layer_and_kv_path(llm):
    before = tvp.stats(llm)["counters"]
    outs = llm.generate(PROMPTS[:1], greedy(4))
    tvp.get_records(llm, outs)
    after = tvp.stats(llm)["counters"]
    steps = after["steps"] - before.get("steps", 0)
    assert steps == 4  # one prefill, three decode steps (the 4th token never enters the model)
    for i in range(NUM_LAYERS):
        for site in ("moe_calls", "kv_calls"):
            key = f"{site}.layer{i}"
            assert after[key] - before.get(key, 0) == steps, key
    assert after["expert_weight_quantizations"] == NUM_LAYERS


def test_logprobs_differ_plausibly_from_bf16(llm, bf16_logprobs):
    fp4, out = _prompt_logprobs(llm)
    assert tvp.get_record(llm, out).num_tokens == len(out.prompt_token_ids)
    delta = (fp4 - bf16_logprobs).abs()
    corr = torch.corrcoef(torch.stack([fp4, bf16_logprobs]))[0, 1]
    scale = bf16_logprobs.abs().mean()
    print(f"mean |delta logp| = {delta.mean():.4f} (max {delta.max():.4f}), mean |logp| = {scale:.3f}, corr = {corr:.3f}")
    assert delta.mean() > 1e-3, "trace_fp4 did not change the model's outputs"
    # NVFP4 everywhere in a 4-layer random model moves token log-probs by ~10% of their size, but
    # keeps which tokens are likely: the two engines rank tokens alike.
    assert delta.mean() < 0.25 * scale, "trace_fp4 changed the outputs implausibly much"
    assert corr > 0.8, "trace_fp4 log-probs are unrelated to the BF16 ones"


LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 4)


def test_records_hold_the_engines_codes(llm):
    assert_records_hold_the_engines_codes(llm, tiny_moe(), LONG, num_layers=NUM_LAYERS, kv_layers=range(NUM_LAYERS))


def test_chunked_prefill_next_to_decodes(llm):
    outs = llm.generate([LONG, *PROMPTS], [greedy(4), greedy(12), greedy(2), greedy(7)])
    for out, rec in zip(outs, tvp.get_records(llm, outs)):
        assert rec.num_tokens == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1


def test_concurrent_requests_get_their_own_records(llm):
    params = [greedy(6), greedy(3), greedy(9)]
    batched = llm.generate(PROMPTS, params)
    records = tvp.get_records(llm, batched)
    for out, rec in zip(batched, records):
        assert rec.num_tokens == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    # The same prompt alone gives the same record: no rows were mixed across requests.
    for prompt, p, rec in zip(PROMPTS, params, records):
        solo = tvp.get_record(llm, llm.generate([prompt], p)[0])
        assert solo.num_tokens == rec.num_tokens
        for name, t in rec.tensors.items():
            assert torch.equal(t, solo.tensors[name]), name
    stats = tvp.stats(llm)
    assert stats["live_requests"] == 0 and stats["done_requests"] == 0 and stats["capture_bytes"] == 0


def test_taking_a_record_twice_or_unknown_fails_clearly(llm):
    out = llm.generate(PROMPTS[:1], greedy(2))[0]
    tvp.get_record(llm, out)
    with pytest.raises(tvp.RecordUnavailable, match="no request"):
        tvp.get_record(llm, out)
    with pytest.raises(tvp.RecordUnavailable, match="no request"):
        tvp.get_record(llm, "not-a-request")


def test_aborted_request_record_is_dropped(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", "The quick brown fox jumps over", greedy(50))
    for _ in range(3):
        engine.step()
    assert tvp.stats(llm)["live_requests"] == 1
    engine.abort_request(["to-abort"])
    # The runner hears of the abort at the next step; a finished request must survive that step.
    finished = llm.generate(PROMPTS[:1], greedy(2))
    stats = tvp.stats(llm)
    assert stats["counters"]["aborted_records_dropped"] == 1
    with pytest.raises(tvp.RecordUnavailable, match="aborted"):
        tvp.get_record(llm, "to-abort")
    assert tvp.get_record(llm, finished[0]).num_tokens == len(finished[0].prompt_token_ids) + 1
    stats = tvp.stats(llm)
    assert stats["live_requests"] == 0 and stats["done_requests"] == 0


def test_shared_prefix_is_recomputed_not_cached(llm):
    # Prefix caching would skip the forward of a cached prefix (no rows to capture); the plugin turns
    # it off, so a repeated prompt gets a complete record again.
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    first = tvp.get_record(llm, llm.generate([LONG], greedy(2))[0])
    second = tvp.get_record(llm, llm.generate([LONG], greedy(2))[0])
    assert first.num_tokens == second.num_tokens
    for name, t in first.tensors.items():
        assert torch.equal(t, second.tensors[name]), name
