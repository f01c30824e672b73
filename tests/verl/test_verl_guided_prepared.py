"""trace_verl.GuidedForward (what verl's forward_step and slime's hook open around the model call) builds
the micro-batch's record tables with trace_megatron.prepare at the model's pre-hook, before the first
layer runs, and guides with them: the forward must give what guidance on the plain records gives (output
bits, every metric), on a THD-packed micro-batch with alignment padding, and still refuse a record of other
tokens. No engine: records from a trace capture of the same weights (the e2e tests cover verl's classes)."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("numba")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from trace_kernels import RecordError, TraceConfig, token_digest  # noqa: E402

from trace_verl.guided import GuidedForward  # noqa: E402
from trace_verl.layout import packed_layout  # noqa: E402

SPARSE = TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.25)
LENGTHS, SEQ = [16, 11, 13], 16


def noisy_engine(x):
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


def _packed(ids):
    """input_ids [1, T] and PackedSeqParams: each sample padded to a multiple of 4, as verl's THD packer does."""
    padded = [(n + 3) // 4 * 4 for n in LENGTHS]
    cu = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    T = int(cu[-1])
    packed_ids, packed_pos = torch.zeros(1, T, dtype=torch.int64), torch.zeros(1, T, dtype=torch.int64)
    for b, n in enumerate(LENGTHS):
        packed_ids[0, cu[b]:cu[b] + n] = ids[b, :n]
        packed_pos[0, cu[b]:cu[b] + padded[b]] = torch.arange(padded[b])
    real = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    return packed_ids, packed_pos, psp


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_guided_forward_prepares_tables_and_guides_like_guidance(monkeypatch, backend):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", backend)
    cfg = mc.tiny_config(params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=2)
    with torch.no_grad(), trace_megatron.capture(model, trace_megatron.TokenLayout.padded(LENGTHS, SEQ),
                                                 perturb=noisy_engine) as cap:
        model(ids, pos, mask)
    # every token but the last sampled one went through the rollout: records of n - 1 rows, digests of them
    full = cap.build_records(SPARSE)
    token_ids = [ids[b, :n] for b, n in enumerate(LENGTHS)]
    records = [r.with_identity(token_digest=token_digest(t.tolist())) for r, t in zip(full, token_ids)]
    packed_ids, packed_pos, psp = _packed(ids)

    prepared = []
    real_prepare = trace_megatron.prepare
    monkeypatch.setattr(trace_megatron, "prepare", lambda *a, **k: prepared.append(real_prepare(*a, **k)) or prepared[-1])
    with torch.no_grad(), GuidedForward(model, records, token_ids) as g:
        out = model(packed_ids, packed_pos, None, packed_seq_params=psp)
    assert len(prepared) == 1 and g.batches[0].tables is prepared[0].tables  # the forward read the prepared tables
    metrics = g.trace_metrics()

    monkeypatch.setattr(trace_megatron, "prepare", real_prepare)
    layout = packed_layout(psp, [r.num_tokens for r in records], packed_ids.shape[-1])
    with torch.no_grad(), trace_megatron.guidance(model, records, layout, token_ids=token_ids) as batch:
        ref = model(packed_ids, packed_pos, None, packed_seq_params=psp)
    assert torch.equal(out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
                       ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref)
    assert metrics == batch.metrics()
    assert metrics["trace/all/k/guided_rows"] > 0  # something was guided

    # a record of other tokens (same length) is still refused at the call, naming the sample
    forged = [records[0].with_identity(token_digest=token_digest(list(range(records[0].num_tokens))))] + records[1:]
    with torch.no_grad(), pytest.raises(RecordError, match="sample 0.*tokens differ"):
        with GuidedForward(model, forged, token_ids):
            model(packed_ids, packed_pos, None, packed_seq_params=psp)
