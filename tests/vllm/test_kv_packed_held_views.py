"""The native attention's per-step index views (kv_packed._step_index): made at a step's first layer call, held
on the step's metadata and reused by its other layers while the metadata holds the same tensors; new tensors
(the next step's) get new views; tensors whose views would be converted copies are never held. No engine."""

import types

import torch

from trace_vllm_plugin.kv_packed import _step_index


def _metadata():
    return types.SimpleNamespace(block_table=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
                                 seq_lens=torch.tensor([20, 9], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))


def _call(md):
    return _step_index(md, md.block_table, md.seq_lens, md.query_start_loc)


def test_a_steps_views_are_made_once_and_read_the_tensors_as_they_are():
    md = _metadata()
    first = _call(md)
    assert _call(md) is first  # the step's other layers: the held views
    md.seq_lens[1] = 10  # rewritten in place: a view sees it
    assert int(first[1][1]) == 10
    assert [a.tolist() for a in first] == [md.block_table.tolist(), md.seq_lens.tolist(), md.query_start_loc.tolist()]


def test_new_tensors_get_new_views_and_copies_are_not_held():
    md = _metadata()
    first = _call(md)
    md.block_table = torch.tensor([[1, 1], [0, 0]], dtype=torch.int32)  # the next step's tensor
    second = _call(md)
    assert second is not first and second[0].tolist() == [[1, 1], [0, 0]]
    md.block_table = torch.tensor([[5, 6, 7, 8], [9, 9, 9, 9]], dtype=torch.int32)[:, ::2]  # not contiguous: a copy
    copied = _call(md)
    assert copied[0].tolist() == [[5, 7], [9, 9]]
    assert _call(md) is not copied  # converted again per call, never held (it would not see in-place writes)
