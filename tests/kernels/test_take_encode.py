"""cpu_native/take_encode.py, the take's one encoder call: every site's payloads and audit blobs from rows
read in place by (chunk, row), byte for byte the reference per record (sparse_encode.encode_payload of
its rows alone, audit.audit_blob_numpy of its drawn rows), on ragged records, rows spread over several
chunks in any order, K=16 and inner dims, static and bf16 amax rows, every rate kind, audits of no row,
one row and every row."""

import numpy as np
import pytest
import torch

from trace_kernels.cpu_native import sparse_encode, take_encode
from trace_kernels.guides.sparse.audit import audit_blob_numpy
from trace_kernels.guides.sparse.rates import Rates, segment
from trace_kernels.guides.sparse.wire import version_for

# (row shape, rates): full-LSB and syndrome scales, wide and narrow code syndromes (> 32 bits: the split
# write), check-only, 4over6 choice bits, a 16-value segment
SITES = [((64,), Rates(8, 4, 20)), ((2, 16), Rates(0, 1, 6, check=True)), ((3, 32), Rates(7, 2, 24, choice=True)),
         ((128,), Rates(5, 2, 0)), ((192,), Rates(3, 1, 62)), ((48,), Rates(2, 1, 9))]


def _meta(sites):
    meta = np.zeros((len(sites), take_encode.META), dtype=np.int64)
    cols, at = [], 0
    for k, (row, r) in enumerate(sites):
        K, seg = row[-1], segment(row[-1])
        bps = seg // 16
        scol = sparse_encode._columns(r.scale_bits, bps, 1) if 0 < r.scale_bits < bps else sparse_encode._columns(0, 0, 1)
        ccol = sparse_encode._columns(r.code_bits, seg, 2)
        meta[k] = (int(np.prod(row[:-1])), K, seg, r.amax_bits, r.scale_bits, r.code_bits, r.check, r.choice,
                   version_for(r), at, len(scol), at + len(scol), len(ccol))
        cols += [scol, ccol]
        at += len(scol) + len(ccol)
    return meta, np.concatenate(cols).astype(np.int64)


def _site_rows(g, T, row, amax_kind):
    lead, K = row[:-1], row[-1]
    codes = g.integers(0, 256, (T, *lead, K // 2), dtype=np.uint8)
    scales = g.integers(0, 256, (T, *lead, K // 16), dtype=np.uint8)
    if amax_kind == "static":
        amax = np.full((T, *lead), 2.5, dtype=np.float32)
    else:
        amax = g.random((T, *lead), dtype=np.float32) * 9
        if amax_kind == "bf16":
            amax = (amax.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return codes, scales, amax


@pytest.mark.parametrize("seed", range(12))
def test_every_payload_and_audit_blob_is_the_per_record_reference(seed):
    g = np.random.default_rng(seed)
    n = int(g.integers(1, 9))
    lens = g.integers(1, 12, n)
    lens[g.integers(0, n)] = 1  # a one-row record
    tokens = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(tokens[-1])
    sites = [SITES[i] for i in g.permutation(len(SITES))[: int(g.integers(1, len(SITES) + 1))]]
    keys = [(k, "s") for k in range(len(sites))]
    amax_kind = ["row", "static", "bf16"][seed % 3]
    # the wanted rows (token t of all records) placed at random rows of random chunks, some runs consecutive
    want = {key: _site_rows(g, T, row, amax_kind) for key, (row, _) in zip(keys, sites)}
    C = int(g.integers(1, 4))
    row_chunk = g.integers(0, C, T).astype(np.int64)
    row_chunk[: T // 2] = row_chunk[0]  # a run in one chunk
    row_index = np.zeros(T, dtype=np.int64)
    arrays = []
    for c in range(C):
        mine = np.flatnonzero(row_chunk == c)
        cap = len(mine) + int(g.integers(0, 5))
        where = np.sort(g.choice(cap, len(mine), replace=False)) if g.random() < 0.5 else np.arange(len(mine)) + (cap - len(mine))
        row_index[mine] = where
        held = {}
        for key in keys:
            parts = []
            for a in want[key]:
                # the other rows random bytes (never read)
                full = g.integers(0, 256, cap * a[:1].nbytes, dtype=np.uint8).view(a.dtype).reshape(cap, *a.shape[1:])
                full[where] = a[mine]
                parts.append(full)
            held[key] = tuple(parts)
        arrays.append(held)
    # audits: none, one row, every row, at random
    draws = []
    for k in range(len(sites)):
        for i in range(n):
            u = g.random()
            L = int(lens[i])
            draws.append([] if u < 0.4 else [int(g.integers(0, L))] if u < 0.7 else list(range(L)) if u < 0.85
                         else sorted(g.choice(L, int(g.integers(1, L + 1)), replace=False).tolist()))
    aud_start = np.concatenate([[0], np.cumsum([len(d) for d in draws])]).astype(np.int64)
    aud_rows = np.array([r for d in draws for r in d], dtype=np.int64)
    meta, cols = _meta(sites)
    out, sizes = take_encode.encode_take(arrays, keys, row_chunk, row_index, tokens, meta, cols, aud_start, aud_rows)
    pieces = np.split(out, np.cumsum(sizes)[:-1])
    assert sizes.sum() == out.size and len(pieces) == len(sites) * 2 * n
    for k, (key, (row, rates)) in enumerate(zip(keys, sites)):
        codes, scales, amax = want[key]
        K = row[-1]
        for i in range(n):
            a, b = tokens[i], tokens[i + 1]
            ref = sparse_encode.encode_payload(torch.from_numpy(codes[a:b]), None, torch.from_numpy(scales[a:b]),
                                               torch.from_numpy(amax[a:b].reshape(-1)), K, segment(K), rates, version_for(rates))
            assert np.array_equal(pieces[k * 2 * n + i], ref.numpy()), (key, i)
            blob = pieces[k * 2 * n + n + i]
            d = draws[k * n + i]
            assert np.array_equal(blob, audit_blob_numpy(np.array(d, dtype=np.int64), codes[a:b]).numpy()), (key, i, d)
            assert blob.size == 0 or d


def test_a_take_reads_rows_in_place_not_gathered(monkeypatch):
    # the arena path of engine/take.py hands the encoder the chunks' own arrays: no numpy gather of site rows
    # (nor of routing ids, every layer of the default config packing them)
    from trace_kernels.engine import host_arena, take

    seen = []
    real = host_arena.gather_rows
    monkeypatch.setattr(take, "gather_rows", lambda rows, keys: seen.append(list(keys)) or real(rows, keys))
    import test_host_arena as tha

    subs = tha.decode_take(11)
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    from trace_kernels import TraceConfig
    from trace_kernels.engine.captured_rows import ChunkJoiner

    out = take.assemble_take(tha.SHAPE, TraceConfig(), [(c, (1, "ab" * 32), None) for c in subs], ChunkJoiner())
    assert all(r is not None for r in out)
    # the packed routing ids are read in place too (cpu_native.take_routing): nothing gathered
    assert not [k for keys in seen for k in keys]
