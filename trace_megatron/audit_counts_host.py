"""site_quant.count_audit's row selection for host tensors, with numpy.

The same rows and the same counts as the torch lines (a gather of each row's audit row, the audited
rows, their audit codes and, moe_fc2_in, the routed slot's): ~8 small integer ops per (layer, site), 16
per step, which on a loaded two-core host cost several times as much as torch ops as in numpy
(token_rows_host.py does the same for the payload). The comparisons stay `codeword_mismatches`.
"""

import numpy as np
import torch
from trace_kernels.guides.full import codeword_mismatches


def host(*ts) -> bool:
    """Whether every tensor (None allowed) is a host tensor numpy can read."""
    return all(t is None or (t.device.type == "cpu" and not t.requires_grad) for t in ts)


def count_audit(stats, by_pos: torch.Tensor, audit: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None,
                rtn_codes: torch.Tensor, ours: torch.Tensor) -> None:
    """site_quant.count_audit after its audit table lookup (`by_pos`, `audit`), for host tensors."""
    a = by_pos.numpy()[positions.numpy()]
    sel = np.flatnonzero(a >= 0)
    if not sel.size:
        return
    theirs = audit.numpy()[a[sel]]  # packed [n, ..., K // 2]
    inner = tuple(ours.shape[1:])
    if theirs.shape[1:] != inner and slots is not None and theirs.shape[2:] == inner:
        # moe_fc2_in: the audit holds every routed slot of the token; this row is its router slot
        theirs = theirs[np.arange(sel.size), slots.numpy()[sel]]
    if theirs.shape[1:] != inner:  # a tensor-parallel shard of the row: not lined up here
        stats.audit_skipped_rows += int(sel.size)
        return
    every = sel.size == ours.shape[0]  # every row audited: the rows as they are
    mine = ours if every else torch.from_numpy(ours.numpy()[sel])
    rtn = rtn_codes if every else torch.from_numpy(rtn_codes.numpy()[sel])
    theirs = torch.from_numpy(theirs)
    stats.audit_rows += int(sel.size)
    stats.audit_values += theirs.numel() * 2
    stats.audit_mismatch += codeword_mismatches(mine, theirs)
    stats.audit_mismatch_rtn += codeword_mismatches(rtn, theirs)
