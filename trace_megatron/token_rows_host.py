"""token_rows.build_payload / decode_rows for host tensors, with numpy.

The same bytes, ids, slots and masks as the torch lines in token_rows.py (integer work only: gathers,
compares, first-max argmax, byte views), in a few numpy calls: a layer's payload and its decode are ~20
small torch ops each, which on a loaded two-core host cost several times their numpy counterparts, four
MoE layers per step. token_rows.py calls these for CPU tensors with rows; GPU tensors and empty batches
take the torch lines.
"""

import numpy as np
import torch


def build_payload(spec, batch, layer: int, positions: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """token_rows.build_payload of host `positions` [n] / `topk_ids` [n, top_k], n > 0."""
    n = positions.numel()
    ids = topk_ids.numpy()
    parts = {
        "position": positions.numpy().astype(np.int64).reshape(n, 1).view(np.uint8),
        "ids": ids.astype(np.int32).reshape(n, -1).view(np.uint8),
    }
    rows = batch.record_rows(positions).numpy()
    has = rows >= 0
    if spec.guide is not None:
        fc1_bytes, fc2_bytes = (t.numpy() for t in batch.payload_bytes(layer))
        r = np.maximum(rows, 0)
        rec_ids = batch.routing_table(layer).numpy()[r]  # [n, top_k]
        # For each router slot: the record slot that routed this token to the same expert (`found`).
        match = rec_ids[:, None, :] == ids[:, :, None].astype(rec_ids.dtype)  # [n, k(router), k(record)]
        found = match.any(-1) & has[:, None]
        rec_slot = match.argmax(-1)  # the first matching record slot, 0 where none (torch's argmax too)
        fc2 = np.take_along_axis(fc2_bytes[r], rec_slot[:, :, None], 1)  # router slot order
        parts["fc1"] = fc1_bytes[r]
        parts["fc2"] = fc2.reshape(n, spec.top_k * fc2_bytes.shape[2])
    else:
        found = np.zeros((n, spec.top_k), dtype=bool)
    parts["has_record"] = has.astype(np.uint8).reshape(n, 1)
    parts["fc2_found"] = found.astype(np.uint8)
    return torch.from_numpy(np.concatenate([parts[name] for name, _ in spec.fields], axis=1))


def decode_rows(spec, payload: torch.Tensor, expert):
    """token_rows.decode_rows of host payload rows [n, P], n > 0 (`expert`: a global id or int64 [n])."""
    from .token_rows import ExpertRows

    n = payload.shape[0]
    p = payload.numpy()
    off, cols = 0, {}
    for name, size in spec.fields:
        cols[name] = p[:, off : off + size]
        off += size
    positions = np.ascontiguousarray(cols["position"]).view(np.int64).reshape(n)
    ids = np.ascontiguousarray(cols["ids"]).view(np.int32).reshape(n, spec.top_k)
    e = expert.numpy() if torch.is_tensor(expert) else expert
    here = ids == (e[:, None] if torch.is_tensor(expert) else e)
    if not bool(here.any(-1).all()):
        bad = int(e[~here.any(-1)][0]) if torch.is_tensor(expert) else expert
        raise RuntimeError(f"trace_megatron: rows reached expert {bad} that the router did not send there")
    slots = here.argmax(-1).astype(np.int64)
    has_record = cols["has_record"].reshape(n).astype(bool)
    fc2_has = np.take_along_axis(cols["fc2_found"].astype(bool), slots[:, None], 1).reshape(n)
    fc1 = fc2 = None
    if spec.guide is not None:
        fc1 = _guide_rows(spec.guide, cols["fc1"], spec.hidden, n)
        per_slot = cols["fc2"].reshape(n, spec.top_k, cols["fc2"].shape[1] // spec.top_k)
        chosen = np.take_along_axis(per_slot, slots[:, None, None], 1).reshape(n, per_slot.shape[-1])
        fc2 = _guide_rows(spec.guide, chosen, spec.inter, n)
    return ExpertRows(torch.from_numpy(positions), torch.from_numpy(slots), torch.from_numpy(has_record), fc1, fc2,
                      torch.from_numpy(fc2_has))


def _guide_rows(kind, b: np.ndarray, K: int, n: int):
    """Guide.from_row_bytes of host byte rows [n, row bytes] (n > 0): each field's columns copied contiguous
    once, then viewed as its dtype."""
    out, off = [], 0
    for shape, dtype in kind.row_fields(K):
        width = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        field = torch.from_numpy(np.ascontiguousarray(b[:, off : off + width])).view(dtype)
        out.append(field.reshape(n, *shape))
        off += width
    return kind(*out)
