"""Records reach the right expert rows whatever Megatron does to the tokens on the way: both token
dispatchers, and packed sequences (THD)."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402

FULL = TraceConfig(guidance="full", guided_layers="all")
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")
LENGTHS, SEQ = [16, 11, 7], 16


def bf16_engine(x):
    return x.to(torch.bfloat16).to(x.dtype)


def _engine_records(model, inputs, layout):
    """Records of a second (BF16-rounding) engine, made with the alltoall dispatcher, padded batch."""
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=bf16_engine) as cap:
        out = model(*inputs)
    return cap.build_records(), out


def _assert_all_guided_exactly(metrics, expected_rows):
    for site in SITES:
        assert metrics[f"trace/all/{site}/mismatch_guided"] == 0, site
        assert metrics[f"trace/all/{site}/mismatch_rtn"] > 0, site
        assert metrics[f"trace/all/{site}/guided_rows"] == expected_rows[site], site


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_both_dispatchers_bring_each_row_its_record(dispatcher):
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=2)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    engine = mc.tiny_model(mc.tiny_config(dispatcher="alltoall"), trace_config=FULL, seed=5)
    records, engine_out = _engine_records(engine, (ids, pos, mask), layout)
    model = mc.tiny_model(mc.tiny_config(dispatcher=dispatcher), trace_config=FULL, seed=5)
    model.load_state_dict(engine.state_dict())
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        out = model(ids, pos, mask)
    n, k, L = sum(LENGTHS), 2, 2
    _assert_all_guided_exactly(batch.metrics(), {"moe_fc1_in": n * k * L, "moe_fc2_in": n * k * L, "k": n * L, "v": n * L})
    valid = layout.sample.view(SEQ, len(LENGTHS)).t() >= 0  # [B, S]
    torch.testing.assert_close(out[valid], engine_out[valid], rtol=0, atol=0)  # the engine's forward, exactly


def test_packed_sequences_find_their_records():
    """Records made on a padded batch guide the same samples packed back to back (THD, padded offsets)."""
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=3)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    model = mc.tiny_model(mc.tiny_config(), trace_config=FULL, seed=6)
    records, engine_out = _engine_records(model, (ids, pos, mask), layout)

    # Pack: each sample padded to a multiple of 4 (as a THD packer for CP/TP alignment would).
    padded_lengths = [(n + 3) // 4 * 4 for n in LENGTHS]
    cu = torch.tensor([0] + padded_lengths).cumsum(0).to(torch.int32)
    T = int(cu[-1])
    packed_ids = torch.zeros(1, T, dtype=torch.int64)
    packed_pos = torch.zeros(1, T, dtype=torch.int64)
    for b, n in enumerate(LENGTHS):
        packed_ids[0, cu[b] : cu[b] + n] = ids[b, :n]
        packed_pos[0, cu[b] : cu[b] + padded_lengths[b]] = torch.arange(padded_lengths[b])
    cu_real = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(padded_lengths), max_seqlen_kv=max(padded_lengths),
    )
    packed_layout = trace_megatron.TokenLayout.packed(cu, lengths=LENGTHS)
    with torch.no_grad(), trace_megatron.guidance(model, records, packed_layout) as batch:
        out = model(packed_ids, packed_pos, None, packed_seq_params=psp)
    m = batch.metrics()
    n = sum(LENGTHS)
    for site in SITES:
        assert m[f"trace/all/{site}/mismatch_guided"] == 0, site
        per_token = 2 if site.startswith("moe") else 1
        assert m[f"trace/all/{site}/guided_rows"] == n * per_token * 2, site
    for b, length in enumerate(LENGTHS):
        torch.testing.assert_close(out[0, cu[b] : cu[b] + length], engine_out[b, :length], rtol=1e-5, atol=1e-5)
