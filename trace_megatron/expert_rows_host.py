"""LayerExpertRows' row bookkeeping for host payload rows, with numpy.

The same integers as the torch lines in expert_rows.py (which expert each row belongs to, the guided
rows of each site, each row's index within its expert, per expert the rows guided at both sites / at
fc1 only / without a record): a handful of small integer ops per MoE layer, which on a loaded two-core
host cost several times as much as torch ops as in numpy (token_rows_host.py does the same for the
payload). Results are torch tensors over the numpy arrays (int64, like torch.nonzero / arange).
"""

import numpy as np
import torch


def local_expert_of_rows(counts: list[int], n: int) -> np.ndarray:
    """int64 [n]: the local expert (0..E-1) of each dispatched row; rows arrive expert after expert."""
    local = np.repeat(np.arange(len(counts), dtype=np.int64), np.asarray(counts, dtype=np.int64))
    if local.shape[0] != n:
        raise RuntimeError(f"trace_megatron: {n} payload rows for experts that received {int(sum(counts))} tokens")
    return local


def guided_rows(local: np.ndarray, counts: list[int], has_record: np.ndarray, fc2_has: np.ndarray):
    """(rows guided at moe_fc1_in: int64 [n1], rows guided at moe_fc2_in: int64 [n2], each row's index
    within its expert: int64 [N], per expert ([both sites], [fc1 only: the record routed it elsewhere],
    [no record]) as lists of ints)."""
    E, N = len(counts), local.shape[0]
    has = has_record.astype(bool, copy=False)
    fc2 = fc2_has.astype(bool, copy=False)
    idx1 = np.flatnonzero(has).astype(np.int64, copy=False)
    idx2 = np.flatnonzero(has & fc2).astype(np.int64, copy=False)
    c = np.asarray(counts, dtype=np.int64)
    start = np.cumsum(c) - c
    row_in_expert = np.arange(N, dtype=np.int64) - start[local]
    # per expert, in one bincount: both sites (0), fc1 only (1), no record (2)
    kind = np.where(has, (~fc2).astype(np.int64), 2)
    per = np.bincount(local * 3 + kind, minlength=3 * E).reshape(E, 3).T.tolist()
    return torch.from_numpy(idx1), torch.from_numpy(idx2), torch.from_numpy(row_in_expert), per
