"""trace_verl's trainer-side bookkeeping: the record cache over a step, and the packed layout."""

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402

import trace_kernels as tk  # noqa: E402
from record_factory import captured_builder  # noqa: E402
from trace_kernels import stores  # noqa: E402


def _records(n, store):
    out = []
    for i in range(n):
        b = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(4, 1), seed=i)
        b.set_identity(token_ids=list(range(i, i + 5)))
        out.append(store.put(b.build()))
    return out


def test_cache_reads_once_per_step_and_deletes_at_its_end(tmp_path):
    from trace_verl.records import RecordCache

    store = stores.open_store(f"file:{tmp_path}")
    step1, step2 = _records(3, store), _records(2, store)
    cache = RecordCache(owner=True)
    recs, info = cache.resolve(step1[:2])  # compute_log_prob's micro-batch
    assert info["resolved_records"] == 2 and info["resolved_bytes"] == sum(r.nbytes for r in recs)
    _, info = cache.resolve([step1[1], step1[0], None], training=True)  # update_actor: same samples, another order
    assert info["resolved_records"] == 0 and info["records_missing"] == 1
    _, info = cache.resolve([step1[2]], training=True)  # the next micro-batch: other samples of the same step
    assert info["resolved_records"] == 1
    assert store.stats()["deleted"] == 0
    cache.end_step()  # the engine's weight export
    assert store.stats()["deleted"] == 3
    _, info = cache.resolve(step2)
    assert info["resolved_records"] == 2
    with pytest.raises(tk.RecordError):
        stores.get(step1[0], consume=False)
    follower = RecordCache(owner=False)  # another rank of the same model-parallel group
    follower.resolve(step2, training=True)
    follower.end_step()
    assert stores.get(step2[0], consume=False).num_tokens == 5


def test_records_not_trained_yet_outlive_a_weight_export(tmp_path):
    """Off-policy order (a batch's log-probs, then a weight export, then its update_actor): its records
    are kept for the training step; one no training forward ever uses goes at the export after next."""
    from trace_verl.records import RecordCache

    store = stores.open_store(f"file:{tmp_path}")
    batch, filtered = _records(2, store), _records(1, store)
    cache = RecordCache(owner=True)
    cache.resolve(batch + filtered)  # compute_log_prob (no_grad)
    cache.end_step()  # weight export before update_actor
    assert store.stats()["deleted"] == 0 and cache.kept_for_training == 3
    _, info = cache.resolve(batch, training=True)
    assert info["resolved_records"] == 0  # still cached, not read again
    cache.end_step()  # the step that used them has finished
    assert store.stats()["deleted"] == 3 and cache.dropped_untrained == 1 and len(cache) == 0


def test_staleness_is_counted_and_refused_beyond_the_limit(tmp_path):
    from trace_verl.metrics import verl_metrics
    from trace_verl.records import record_staleness

    records = []
    for i, version in enumerate((5, 3, 4)):
        b = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(4, 1), seed=i)
        b.set_identity(token_ids=list(range(5)), weights_version=version)
        records.append(b.build())
    lags, stale_tokens = record_staleness(records + [None], 5, accept_stale=True, max_staleness=2)
    assert lags == [0, 2, 1] and stale_tokens == 2 * records[0].num_tokens
    m = verl_metrics({}, records, {}, staleness=lags, stale_tokens=stale_tokens)
    assert m["trace_fp4/records/staleness_mean"] == 1.0 and m["trace_fp4/records/staleness_max"] == 2.0
    assert m["trace_fp4/records/stale_tokens"] == 2 * records[0].num_tokens
    with pytest.raises(tk.RecordError, match="sample 1: .*weights version 3, 2 versions older than the trainer's 5; .*at most 1"):
        record_staleness(records, 5, accept_stale=True, max_staleness=1)
    with pytest.raises(tk.RecordError, match="sample 1: .*weights version 3, the trainer has 5 .*accept_stale"):
        record_staleness(records, 5, accept_stale=False, max_staleness=None)
    with pytest.raises(tk.RecordError, match="sample 0: .*version 5 is newer than the trainer's 4"):
        record_staleness(records, 4, accept_stale=True, max_staleness=None)
    assert record_staleness(records, None, accept_stale=False, max_staleness=None) == ([], 0)  # before any export


def test_a_partial_rollouts_tokens_are_judged_by_their_own_versions():
    """A record stitched from a request aborted at a weight update (rows 0..2 by version 3) and its
    continuation (rows 3.. by version 5): on-policy tokens are not stale, the older ones are counted,
    and rows beyond max_staleness are refused naming both versions."""
    from trace_verl.records import record_staleness

    b = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(4, 1), seed=0)
    b.set_identity(token_ids=list(range(5)), weights_version=5)
    whole = b.build()
    partial = whole.with_identity(version_ranges=((0, 3), (3, 5)))
    assert record_staleness([partial], 5, accept_stale=True, max_staleness=2) == ([2], 3)
    with pytest.raises(tk.RecordError, match=r"sample 0: rows 0\.\.2 of the record \(a partial rollout\) was made with "
                       r"weights version 3, 2 versions older than the trainer's 5; .*at most 1"):
        record_staleness([partial], 5, accept_stale=True, max_staleness=1)
    with pytest.raises(tk.RecordError, match=r"rows 0\.\.2 .*weights version 3, the trainer has 5"):
        record_staleness([partial], 5, accept_stale=False, max_staleness=None)
    # the trainer-side identity check agrees: the newest version matches, the older rows need accept_stale
    with pytest.raises(tk.RecordError, match=r"rows 0\.\.2 of the record \(a partial rollout\) were made with weights version 3"):
        tk.check_identity(partial, source="sample 0", weights_version=5)
    assert tk.check_identity(partial, source="sample 0", weights_version=5, accept_stale=True) == "stale"
    assert tk.check_identity(whole, source="sample 0", weights_version=5) is None


def test_packed_layout_from_verls_packed_seq_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    from trace_verl.layout import packed_layout

    real = torch.tensor([0, 7, 10, 16], dtype=torch.int32)  # sample lengths 7, 3, 6
    padded = torch.tensor([0, 8, 12, 20], dtype=torch.int32)  # aligned to 4, as verl's THD packer does
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                          cu_seqlens_kv_padded=padded)
    layout = packed_layout(psp, [6, None, 5], 20)  # sample 1 has no record
    assert layout.num_samples == 2
    assert layout.sample.tolist() == [0] * 6 + [-1] * 6 + [1] * 5 + [-1] * 3
    assert layout.token[:6].tolist() == list(range(6)) and layout.token[12:17].tolist() == list(range(5))
    with pytest.raises(ValueError, match="sample 1: its record covers 4 tokens, the micro-batch holds 3"):
        packed_layout(psp, [6, 4, 5], 20)
    with pytest.raises(ValueError, match="3 samples, 2 handles"):
        packed_layout(psp, [6, 4], 20)


def test_cache_resolves_only_its_configured_store(tmp_path):
    """A handle in the batch naming another store is refused, and that store is left as it was."""
    from trace_verl.records import RecordCache

    mine = stores.open_store(f"file:{tmp_path / 'mine'}")
    other = stores.open_store(f"file:{tmp_path / 'other'}")
    (h,) = _records(1, other)
    cache = RecordCache(owner=True, allowed=[mine])
    with pytest.raises(tk.RecordError, match="not an allowed store.*" + str(tmp_path / "mine")):
        cache.resolve([h])
    cache.end_step()
    assert other.stats()["outstanding"] == 1
    (ok,) = _records(1, mine)
    assert cache.resolve([ok])[1]["resolved_records"] == 1
