"""The multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING=1): records come back over vLLM's IPC,
one per request, with no rows mixed across the requests of a batch."""

import pytest
import torch

import trace_vllm_plugin as tvp
from vllm_helpers import FULL_ALL, PROMPTS, greedy, make_llm, shutdown, tiny_moe


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, multiprocess=True)
    yield llm
    shutdown(llm)


def test_engine_runs_in_another_process(llm):
    from vllm.v1.engine.core_client import SyncMPClient

    assert isinstance(llm.llm_engine.engine_core, SyncMPClient)


def test_concurrent_requests_get_their_own_records(llm):
    params = [greedy(6), greedy(3), greedy(9)]
    batched = llm.generate(PROMPTS, params)
    records = tvp.get_records(llm, batched)
    for out, rec in zip(batched, records):
        assert rec.num_tokens == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    for prompt, p, rec in zip(PROMPTS, params, records):
        solo = tvp.get_record(llm, llm.generate([prompt], p)[0])
        for name, t in rec.tensors.items():
            assert torch.equal(t, solo.tensors[name]), name
    stats = tvp.stats(llm)
    assert stats["counters"]["records_taken"] == 2 * len(PROMPTS)
    assert stats["capture_bytes"] == 0


def test_untaken_records_are_freed_by_discard(llm):
    # Records nobody takes (e.g. the caller aborted its rollout) are freed on demand.
    llm.generate(PROMPTS, greedy(2))
    assert tvp.stats(llm)["capture_bytes"] > 0
    # The runner learns that requests finished at the next engine step.
    tvp.get_records(llm, llm.generate(PROMPTS[:1], greedy(1)))
    assert tvp.discard_records(llm) == len(PROMPTS)
    stats = tvp.stats(llm)
    assert stats["live_requests"] == 0 and stats["done_requests"] == 0 and stats["capture_bytes"] == 0
    assert stats["counters"]["discarded_records"] == len(PROMPTS)


def test_handles_from_the_worker_process(llm, tmp_path, monkeypatch):
    # The store comes from the caller's environment; the worker (another process) writes the file and
    # only the handle crosses vLLM's IPC. The record resolved here carries its sample's identity.
    import trace_kernels
    from trace_kernels import stores

    monkeypatch.setenv(stores.STORE_ENV, f"file:{tmp_path}")
    outs = llm.generate(PROMPTS[:2], [greedy(4), greedy(2)])
    handles = tvp.get_records(llm, outs)
    assert all(stores.is_handle(h) for h in handles)
    for out, h in zip(outs, handles):
        rec = stores.get(h)
        trace_kernels.check_identity(rec, source=h, token_ids=list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
    assert stores.open_store(tmp_path).stats()["outstanding"] == 0
