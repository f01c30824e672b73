"""Guidance rows under context parallelism follow the token order the CP ranks actually hold.

Checked against the real splitting code, not a re-derivation: Megatron-Core's load-balanced
`get_batch_on_this_cp_rank` (padded batches) and verl's `preprocess_packed_seqs` (packed sequences,
the order verl's Megatron engine feeds each CP rank). Both read this rank's CP size / rank from the
process group state, which a single process cannot hold for CP=2, so those two getters are set per
call (the splitting itself runs unchanged)."""

import pytest
import torch

pytest.importorskip("megatron.core")
from trace_megatron import TokenLayout  # noqa: E402
from trace_megatron.layout import cp_chunk_index  # noqa: E402

CP = 2


def _codes(layout: TokenLayout) -> torch.Tensor:
    """One id per flat position: 1000 * (sample + 1) + token + 1, 0 for padding."""
    return torch.where(layout.sample >= 0, 1000 * (layout.sample + 1) + layout.token + 1, 0)


def test_padded_batch_matches_megatrons_load_balanced_split(monkeypatch):
    from megatron.core import utils

    lengths, S = [16, 11, 5], 16
    full = TokenLayout.padded(lengths, S)
    ids = _codes(full).view(S, len(lengths)).t().contiguous()  # input_ids [B, S]
    for rank in range(CP):
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: CP)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        theirs = utils._get_batch_on_this_cp_rank_per_sequence_balancing({"tokens": ids.clone()}, cp_group=None)["tokens"]
        ours = full.context_parallel_shard(CP, rank)
        assert ours.seq_len == S // CP
        assert torch.equal(_codes(ours).view(S // CP, len(lengths)).t(), theirs)


def test_packed_sequences_match_verls_cp_packing(monkeypatch):
    pytest.importorskip("verl")
    from verl.models.mcore import util as verl_util

    from trace_verl.layout import packed_layout

    lengths = [7, 3, 12]
    B, S = len(lengths), max(lengths)
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(mask, 1000 * (torch.arange(B)[:, None] + 1) + torch.arange(S)[None, :] + 1, 0)
    records = [7, None, 11]  # sample 1 has no record; sample 2's covers all but its last token
    for rank in range(CP):
        monkeypatch.setattr(verl_util.mpu, "get_tensor_model_parallel_world_size", lambda: 1)
        monkeypatch.setattr(verl_util.mpu, "get_context_parallel_world_size", lambda: CP)
        monkeypatch.setattr(verl_util.mpu, "get_context_parallel_rank", lambda r=rank: r)
        local_ids, psp = verl_util.preprocess_packed_seqs(ids, mask, pre_process=True)
        local_ids = local_ids.flatten()
        layout = packed_layout(psp, records, local_ids.numel(), cp=(CP, rank))
        # Where the layout says (record k, token t), verl placed that sample's token t.
        with_record = [i for i, r in enumerate(records) if r is not None]
        expect = torch.where(
            layout.sample >= 0,
            1000 * (torch.tensor(with_record)[layout.sample.clamp(min=0)] + 1) + layout.token + 1, 0,
        )
        placed = layout.sample >= 0
        assert placed.sum() > 0
        assert torch.equal(local_ids[placed], expect[placed])
        # Every real token of a sample with a record is placed unless it lies beyond the record.
        for k, i in enumerate(with_record):
            held = local_ids[(local_ids > 1000 * (i + 1)) & (local_ids <= 1000 * (i + 1) + records[i])]
            assert int((layout.sample == k).sum()) == held.numel()


def test_a_length_that_cannot_be_split_evenly_is_refused():
    with pytest.raises(ValueError, match="cannot be split in 4 equal chunks"):
        cp_chunk_index(6, CP, 0)
    assert cp_chunk_index(8, CP, 1).tolist() == [2, 3, 4, 5]
