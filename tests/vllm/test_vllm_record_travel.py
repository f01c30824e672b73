"""Records made by real vLLM travel bound to their sample and policy: identity, handles (local files
and Ray), n > 1 samples per prompt, prefix caching kept on with hits served from the prompt rows.

One in-process engine for the module, with TRACE_FP4_PREFIX_CACHING=1 (prefix caching stays on)."""

import os

import pytest
import torch

import trace_kernels as tk
import trace_vllm_plugin as tvp
from trace_kernels import stores
from vllm_helpers import FULL_ALL, PROMPTS, greedy, make_llm, shutdown, tiny_moe

# About 230 tokens: longer than one KV block (128 tokens on the CPU backend), so a repeated prompt
# hits the prefix cache.
LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 6)


@pytest.fixture(scope="module")
def llm():
    os.environ["TRACE_FP4_PREFIX_CACHING"] = "1"
    try:
        llm = make_llm(tiny_moe(), quant_config=FULL_ALL)
    finally:
        del os.environ["TRACE_FP4_PREFIX_CACHING"]
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    yield llm
    shutdown(llm)


def _sampled(n, seed=0, max_tokens=5):
    from vllm import SamplingParams

    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def _tokens(out, j=0):
    return list(out.prompt_token_ids) + list(out.outputs[j].token_ids)


def test_records_carry_identity_and_the_trainer_refuses_what_does_not_belong(llm):
    outs = llm.generate(PROMPTS[:2], greedy(4))
    records = tvp.get_records(llm, outs)
    ids = [_tokens(o) for o in outs]
    for rec, seq, out in zip(records, ids, outs):
        assert rec.identity.token_digest == tk.token_digest(seq[: rec.num_tokens])
        assert rec.identity.num_prompt_tokens == len(out.prompt_token_ids)
        assert rec.identity.weights_version == 0 and len(rec.identity.weights_digest) == 64
        tk.check_identity(rec, source="ok", token_ids=seq, weights_version=0)
    # Swapped records, a truncated one, one of another prompt of the same length.
    with pytest.raises(tk.RecordError, match=r"sample 0 \(request \S+\): (tokens|length) differ"):
        tk.check_identity(records[1], source="record of sample 0", token_ids=ids[0])
    with pytest.raises(tk.RecordError, match=r"sample 0 \(request \S+\): length differs: the record holds \d+ token rows, the trainer runs"):
        short = tvp.get_record(llm, llm.generate(PROMPTS[2:3], greedy(1))[0])
        tk.check_identity(short, source="record of sample 0", token_ids=ids[0])
    same_len = llm.generate([PROMPTS[0].replace("quick", "slow")], greedy(4))[0]
    other = tvp.get_record(llm, same_len)
    assert other.num_tokens == records[0].num_tokens and _tokens(same_len) != ids[0]
    with pytest.raises(tk.RecordError, match=r"sample 0 \(request \S+\): tokens differ"):
        tk.check_identity(other, source="record of sample 0", token_ids=ids[0])


def test_weights_version_set_by_the_driver_and_stale_records(llm):
    tvp.set_weights_version(llm, 7)
    try:
        out = llm.generate(PROMPTS[:1], greedy(3))[0]
        rec = tvp.get_record(llm, out)
    finally:
        tvp.set_weights_version(llm, None)
    assert rec.identity.weights_version == 7
    with pytest.raises(tk.RecordError, match="record of sample 0 \\(request \\S+\\): weights differ: the record was made with weights version 7, the trainer expects 8"):
        tk.check_identity(rec, source="record of sample 0", token_ids=_tokens(out), weights_version=8)
    assert tk.check_identity(rec, source="s", token_ids=_tokens(out), weights_version=8, accept_stale=True) == "stale"


def test_new_rates_reach_the_engine_and_records_say_which_they_used(llm):
    import dataclasses

    base = tk.TraceConfig.from_dict(FULL_ALL)
    new = dataclasses.replace(base, sparse_rates={"1.k": [3, 1, 15]}, rates_version=3)
    tvp.set_rates(llm, new)
    try:
        rec = tvp.get_record(llm, llm.generate(PROMPTS[:1], greedy(2))[0])
        with pytest.raises(Exception, match=r"may change only .*also changes \['guidance'\]"):
            tvp.set_rates(llm, dataclasses.replace(new, guidance="compact"))
    finally:
        tvp.set_rates(llm, base)
    assert rec.config.rates_version == 3 and rec.config.sparse_rates == {"1.k": [3, 1, 15]}
    rec.check_compatible(rec.shape, base)  # the trainer's config need not have caught up yet
    later = tvp.get_record(llm, llm.generate(PROMPTS[:1], greedy(2))[0])
    assert later.config == base


def test_n_samples_per_prompt_one_record_each_in_order(llm):
    out = llm.generate([LONG], _sampled(4))[0]
    assert len(out.outputs) == 4
    records = tvp.get_records(llm, [out])
    assert len(records) == 4
    P = len(out.prompt_token_ids)
    for j, rec in enumerate(records):
        seq = _tokens(out, j)
        assert rec.num_tokens == len(seq) - 1
        tk.check_identity(rec, source=f"completion {j}", token_ids=seq)
        # The prompt rows are the same in every sample (computed once, or served from the prefix cache).
        for name, t in rec.tensors.items():
            assert torch.equal(t[:P], records[0].tensors[name][:P]), (j, name)
    assert len({r.identity.token_digest for r in records}) == 4


def test_prefix_cache_hit_is_served_from_the_prompt_rows(llm):
    before = tvp.stats(llm)["counters"]
    first_out = llm.generate([LONG + " one"], greedy(3))[0]
    first = tvp.get_record(llm, first_out)
    out = llm.generate([LONG + " two"], greedy(3))[0]
    second = tvp.get_record(llm, out)
    after = tvp.stats(llm)["counters"]
    served = after.get("prefix_hit_rows_served", 0) - before.get("prefix_hit_rows_served", 0)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    assert served >= block and served % block == 0, after  # whole KV blocks of the shared prefix
    assert out.num_cached_tokens >= block and first_out.num_cached_tokens + out.num_cached_tokens == served
    served = out.num_cached_tokens
    assert second.num_tokens == len(_tokens(out)) - 1
    tk.check_identity(second, source="second", token_ids=_tokens(out))
    for name, t in second.tensors.items():
        assert torch.equal(t[:served], first.tensors[name][:served]), name
    assert after.get("prefix_hits_not_served", 0) == before.get("prefix_hits_not_served", 0)


def test_handles_from_a_local_store_are_byte_identical(llm, tmp_path):
    spec = f"file:{tmp_path}"
    outs = llm.generate(PROMPTS, greedy(3))
    handles = tvp.get_records(llm, outs, store=spec)
    assert all(stores.is_handle(h) and h.startswith(f"trace-fp4:{spec}#") for h in handles)
    records = [stores.get(h) for h in handles]
    for rec, out in zip(records, outs):
        tk.check_identity(rec, source="stored", token_ids=_tokens(out))
        h = stores.open_store(spec).put(rec)
        assert stores.get(h).to_bytes() == rec.to_bytes()
    assert stores.open_store(spec).stats()["outstanding"] == 0
    with pytest.raises(tk.RecordError, match=f"{handles[0]}: no such record"):
        stores.get(handles[0])


def test_group_of_n_in_the_ray_store_shares_its_prompt_part(llm):
    ray = pytest.importorskip("ray")
    import tempfile

    # A short temp dir: Ray's socket paths must stay under 107 bytes.
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
             _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    try:
        out = llm.generate([LONG], _sampled(4, seed=3))[0]
        handles = tvp.get_records(llm, [out], store="ray:vllm_test")
        store = stores.open_store("ray:vllm_test")
        s = store.stats()
        assert s["put"] == 4 and s["prefix_parts_put"] == 1 and s["prefix_parts_reused"] == 3, s
        for j, h in enumerate(handles):
            rec = stores.get(h)
            tk.check_identity(rec, source=f"completion {j}", token_ids=_tokens(out, j))
        assert store.stats()["store"] == {"put": 4, "taken": 4, "deleted": 0, "outstanding": 0, "prompt_parts": 0}
    finally:
        ray.shutdown()
