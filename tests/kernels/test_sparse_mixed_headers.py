"""Rows of records whose sparse headers differ decode together: a trainer layer's site concatenates every
record's rows, and records differ in rates (a controller moved them between weight syncs) or in the amax
form (a record whose site had one amax for all rows, e.g. a 1-token sample's moe_fc1_in, was sent
static). Found when a micro-batch of samples 10 / 3 / 64 / 1 tokens was refused ("inconsistent row
headers") by the expert predecode."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse.decoder import decode_dequantized
from trace_kernels.guides.sparse.header import header_groups

K = 64


def _part(seed: int, rows: int, *, static: bool = False, rates=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(torch.bfloat16)
    q = tk.quantize(x, torch.tensor([8.0]) if static else tk.row_amax(x))
    guide = sg.unpack(sg.pack(sg.encode(q, "k", rates)), (rows,), K)  # through the wire, as a record holds it
    return x, q, guide


def _mixed():
    r = sg.rates_for("k", K)
    parts = [_part(1, 5), _part(2, 1, static=True), _part(3, 4, rates=sg.Rates(r.amax_bits + 2, r.scale_bits,
                                                                                   r.code_bits + 4)),
             _part(4, 3, static=True), _part(5, 2)]
    perm = torch.randperm(15, generator=torch.Generator().manual_seed(0))  # the records' rows interleaved
    x = torch.cat([p[0] for p in parts])[perm]
    q = [torch.cat(t)[perm] for t in zip(*((p[1].codes, p[1].scales, p[1].global_amax.expand(p[0].shape[0]))
                                            for p in parts))]
    guide = type(parts[0][2]).cat([p[2] for p in parts])[perm]
    return x, tk.NVFP4Tensor(*q), guide, parts, perm


def test_the_headers_fall_into_one_group_per_rates_and_static_amax():
    _, _, guide, _, _ = _mixed()
    groups = header_groups(guide.row_header)
    # rates A (parts 1, 5), rates B (part 3), two static amaxes equal in value: one group of both
    assert sorted(len(g) for g in groups) == [4, 4, 7]
    assert sorted(torch.cat(groups).tolist()) == list(range(15))
    assert header_groups(_part(1, 5)[2].row_header) is None


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_mixed_rows_decode_as_each_record_alone(backend):
    x, q, guide, parts, perm = _mixed()
    report = sg.DecodeReport()
    decoded, values = decode_dequantized(guide, x, report, backend=backend)
    assert torch.equal(tk.codewords(decoded), tk.codewords(q))  # the trainer's values are the rollout's
    assert torch.equal(decoded.scales, q.scales) and torch.equal(decoded.global_amax, q.global_amax)
    assert torch.equal(values, decoded.dequantize(x.dtype))
    assert report.rows == 15 and report.unresolved_code_segments == 0
    # each row decoded with its record's rows alone gives the same bytes
    alone = torch.cat([sg.decode(p[2], p[0], backend=backend).codes for p in parts])[perm]
    assert torch.equal(decoded.codes, alone)


def test_one_static_record_beside_per_row_records_in_a_trainer_batch():
    """The path that refused: the same rows under a [2, ...] lead, the first record static."""
    x1, q1, g1 = _part(7, 2, static=True)
    x2, q2, g2 = _part(8, 2)
    guide = type(g1).cat([g1, g2]).map_rows(lambda t: t.reshape(2, 2, *t.shape[1:]))
    decoded = sg.decode(guide, torch.cat([x1, x2]).reshape(2, 2, K))
    assert decoded.codes.shape == (2, 2, K // 2)
    assert torch.equal(tk.codewords(decoded).reshape(4, K), torch.cat([tk.codewords(q1), tk.codewords(q2)]))
