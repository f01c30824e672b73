"""cpu_native/take_routing.py, the take's one routing packer: every packed MoE layer's ids of every record
read in place by (chunk, row) and packed byte for byte as records.routing.pack_routing packs each record's
ids alone, on ragged records, rows spread over several chunks in any order, every id bit width (2..256
experts); an id outside [0, num_experts) refused with its layer, and an engine take holding one left to
the per-record build, which names it."""

import numpy as np
import pytest
import torch

from trace_kernels import TraceConfig, cpu_native
from trace_kernels.cpu_native import take_routing
from trace_kernels.records.routing import id_bits, pack_routing


def _spread(g, per_record_rows, top_k, num_experts, n_layers, n_chunks):
    """Each layer's ids of every token (all records back to back), and where they lie: per layer one int16
    [rows, top_k] array per chunk holding them at shuffled (chunk, row) places among rows of noise."""
    T = sum(per_record_rows)
    ids = g.integers(0, num_experts, (n_layers, T, top_k)).astype(np.int16)
    ids[:, :1] = num_experts - 1  # the widest id of the width at least once
    row_chunk = g.integers(0, n_chunks, T)
    row_index = np.zeros(T, dtype=np.int64)
    size = np.zeros(n_chunks, dtype=np.int64)
    for t in g.permutation(T):  # rows placed in no order of tokens
        row_index[t] = size[row_chunk[t]]
        size[row_chunk[t]] += 1 + int(g.integers(0, 2))  # a gap of noise now and then
    arrays = [[g.integers(-9, 9, (int(size[c]) + 1, top_k)).astype(np.int16) for c in range(n_chunks)]
              for _ in range(n_layers)]
    for k in range(n_layers):
        for t in range(T):
            arrays[k][row_chunk[t]][row_index[t]] = ids[k, t]
    return ids, arrays, row_chunk.astype(np.int64), row_index


@pytest.mark.parametrize("num_experts", [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256])
def test_every_record_of_every_layer_is_pack_routing_of_its_ids(num_experts):
    g = np.random.default_rng(num_experts)
    for top_k, per, n_chunks in ((1, [1], 1), (2, [3, 1, 7, 2], 3), (8, [5, 11, 1], 2), (3, [13, 1, 1, 6, 2], 4)):
        ids, arrays, row_chunk, row_index = _spread(g, per, top_k, num_experts, 3, n_chunks)
        tokens = np.cumsum([0] + per).astype(np.int64)
        out, sizes, bad = take_routing.pack_take(arrays, row_chunk, row_index, tokens, top_k, num_experts,
                                                 id_bits(num_experts))
        assert bad == 0
        views = torch.from_numpy(out).split(sizes.tolist())
        n = len(per)
        for k in range(3):
            for i in range(n):
                want = pack_routing(torch.from_numpy(ids[k, tokens[i] : tokens[i + 1]]), num_experts)
                got = views[k * n + i]
                assert got.dtype == want.dtype and torch.equal(got, want), (num_experts, top_k, k, i)


@pytest.mark.parametrize("bad_id", [-1, 6, 32767])
def test_an_id_out_of_range_is_refused_with_its_layer(bad_id):
    g = np.random.default_rng(1)
    ids, arrays, row_chunk, row_index = _spread(g, [4, 3], 2, 6, 3, 2)
    arrays[1][row_chunk[5]][row_index[5], 1] = bad_id  # layer 1, the second record's second token
    _, _, bad = take_routing.pack_take(arrays, row_chunk, row_index, np.array([0, 4, 7], dtype=np.int64), 2, 6,
                                       id_bits(6))
    assert bad == 2  # 1 + the layer's index


def _arena_take(seed):
    """Two requests' StepChunks on a host-arena store (their decode steps), and the store's shape."""
    import test_host_arena as tha

    return tha.SHAPE, tha.decode_take(seed)


@pytest.mark.parametrize("config", [TraceConfig(), TraceConfig(guided_layers=[1])])
def test_an_arena_take_packs_in_place_the_bytes_of_the_record_built_alone(monkeypatch, config):
    # every layer packed (nothing gathered), and one layer unguided (its int16 ids gathered, as before)
    from trace_kernels.engine import assemble_record, host_arena, take
    from trace_kernels.engine.captured_rows import ChunkJoiner

    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    seen = []
    real = host_arena.gather_rows
    monkeypatch.setattr(take, "gather_rows", lambda rows, keys: seen.append(list(keys)) or real(rows, keys))
    shape, subs = _arena_take(21)
    out = take.assemble_take(shape, config, [(c, (1, "ab" * 32), None) for c in subs], ChunkJoiner())
    modes = config.layer_modes(shape.num_layers)
    assert [k for keys in seen for k in keys] == [("routing", layer) for layer in range(shape.num_layers)
                                                  if modes[layer] is None]
    for rec, c in zip(out, subs):
        alone = assemble_record(shape, config, c, weights=(1, "ab" * 32))
        assert list(rec.tensors) == list(alone.tensors)
        for name, t in alone.tensors.items():
            assert rec.tensors[name].dtype == t.dtype and torch.equal(rec.tensors[name], t), name


def test_an_arena_take_with_an_id_out_of_range_is_left_to_the_record_builder_which_names_it(monkeypatch):
    from trace_kernels.engine import assemble_record, take
    from trace_kernels.engine.captured_rows import ChunkJoiner

    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    shape, subs = _arena_take(22)
    step, (lo, _) = subs[1].steps[2], subs[1].ranges[2]
    step.chunk.arrays[("routing", 1)][0][step.offset + lo, 0] = shape.num_experts  # request b, layer 1
    before = cpu_native.FALLBACKS["per_record:take"]
    out = take.assemble_take(shape, TraceConfig(), [(c, (1, "ab" * 32), None) for c in subs], ChunkJoiner())
    assert out == [None, None]
    assert cpu_native.FALLBACKS["per_record:take"] - before == 2
    assemble_record(shape, TraceConfig(), subs[0], weights=(1, "ab" * 32))  # request a's rows are fine
    with pytest.raises(ValueError, match=r"layer 1: routing ids outside \[0, 4\)"):
        assemble_record(shape, TraceConfig(), subs[1], weights=(1, "ab" * 32))
