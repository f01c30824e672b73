"""Carry each token's guide rows through Megatron's token dispatcher to the experts that process it.

Before dispatch, every local token gets one byte row (its "payload"): its flat position, the router's
top-k expert ids (slot order), and for a guided layer its `moe_fc1_in` guide row and its `moe_fc2_in`
guide rows re-ordered to those slots. After Megatron's dispatcher has moved the hidden states, the same
moves are replayed on the payload from the dispatcher's own routing state, so row i of an expert's input
and row i of its payload describe the same (token, expert) pair — on whichever rank the expert lives,
which is what expert parallelism needs (records stay with the rank that owns the sample).

Supported dispatchers: allgather and alltoall (without capacity dropping / padding). Permutation is
replayed with Megatron's unfused `permute` / `sort_chunks_by_idxs`, which order rows exactly as the
fused kernels do (expert-major, then token order).
"""

from dataclasses import dataclass

import math

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from trace_kernels import Guide

from . import token_rows_host

try:  # the communication helper the alltoall dispatcher uses
    from megatron.core.tensor_parallel.mappings import all_to_all
except ImportError:  # pragma: no cover
    all_to_all = None


@dataclass(frozen=True)
class PayloadSpec:
    """Byte layout of one token's payload for a layer (guide None: only position and routing)."""

    top_k: int
    hidden: int
    inter: int
    guide: type[Guide] | None  # the layer's guide encoding

    @property
    def fields(self) -> list[tuple[str, int]]:
        f = [("position", 8), ("ids", 4 * self.top_k), ("has_record", 1), ("fc2_found", self.top_k)]
        if self.guide is not None:
            f += [("fc1", self.guide.row_nbytes(self.hidden)), ("fc2", self.top_k * self.guide.row_nbytes(self.inter))]
        return f

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.fields)


def _bytes_as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret byte columns of the payload as `dtype`. A copy, because a column slice can be
    contiguous (one row) yet start at an offset that is not a multiple of the element size."""
    return columns.clone(memory_format=torch.contiguous_format).view(dtype)


def _host(*ts: torch.Tensor) -> bool:
    """Whether every tensor is a host tensor numpy can read (token_rows_host.py)."""
    return all(t.device.type == "cpu" and not t.requires_grad for t in ts)


def _bytes(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, ...] -> uint8 [n, row bytes]; widths are explicit so that n == 0 (an expert or a rank
    without tokens) keeps its shape."""
    return t.contiguous().view(torch.uint8).reshape(n, math.prod(t.shape[1:]) * t.element_size())


def build_payload(spec: PayloadSpec, batch, layer: int, positions: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """uint8 [n, spec.nbytes] for the local tokens at flat `positions`, routed to `topk_ids` [n, top_k]."""
    n = positions.numel()
    if n and _host(positions, topk_ids) and batch.device.type == "cpu":
        return token_rows_host.build_payload(spec, batch, layer, positions, topk_ids)  # the same bytes, with numpy
    parts = {
        "position": _bytes(positions.to(torch.int64), n),
        "ids": _bytes(topk_ids.to(torch.int32), n),
    }
    rows = batch.record_rows(positions)
    has = rows >= 0
    if spec.guide is not None:
        # the guide rows as payload bytes, made once per batch's records (RecordTables.payload_bytes)
        fc1_bytes, fc2_bytes = batch.payload_bytes(layer)
        r = rows.clamp(min=0)
        rec_ids = batch.routing_table(layer)[r]  # [n, top_k]
        # For each router slot: the record slot that routed this token to the same expert (`found`).
        match = rec_ids[:, None, :] == topk_ids[:, :, None].to(rec_ids.dtype)  # [n, k(router), k(record)]
        found = match.any(-1) & has[:, None]
        rec_slot = match.to(torch.int64).argmax(-1)
        fc2 = torch.gather(fc2_bytes[r], 1, rec_slot[:, :, None].expand(-1, -1, fc2_bytes.shape[2]))  # router slot order
        parts["fc1"] = fc1_bytes[r]
        parts["fc2"] = fc2.reshape(n, spec.top_k * fc2_bytes.shape[2])
    else:
        found = torch.zeros(n, spec.top_k, dtype=torch.bool, device=positions.device)
    parts["has_record"] = has.to(torch.uint8).reshape(n, 1)
    parts["fc2_found"] = found.to(torch.uint8)
    return torch.cat([parts[name] for name, _ in spec.fields], dim=1)


@dataclass
class ExpertRows:
    """Decoded payload rows of one expert's input (global expert id `expert`)."""

    positions: torch.Tensor  # int64 [n]
    slots: torch.Tensor  # int64 [n]: router slot that sent the token here
    has_record: torch.Tensor  # bool [n]
    fc1_guide: Guide | None  # guide rows [n, hidden] or None (layer not guided)
    fc2_guide: Guide | None  # guide rows [n, inter] or None
    fc2_has: torch.Tensor  # bool [n]: the record routed this token to this expert too


def decode_rows(spec: PayloadSpec, payload: torch.Tensor, expert) -> ExpertRows:
    """The payload rows of one expert's input (`expert`: its global id), or of several experts' at once
    (`expert`: int64 [n], the global id each row was dispatched to)."""
    n = payload.shape[0]
    if n and _host(payload, *([expert] if torch.is_tensor(expert) else [])):
        return token_rows_host.decode_rows(spec, payload, expert)  # the same rows, with numpy
    off, cols = 0, {}
    for name, size in spec.fields:
        cols[name] = payload[:, off : off + size]
        off += size
    positions = _bytes_as(cols["position"], torch.int64).reshape(n)
    ids = _bytes_as(cols["ids"], torch.int32).reshape(n, spec.top_k)
    here = ids == (expert[:, None] if torch.is_tensor(expert) else expert)
    if n and not bool(here.any(-1).all()):
        bad = expert[~here.any(-1)][0].item() if torch.is_tensor(expert) else expert
        raise RuntimeError(f"trace_megatron: rows reached expert {bad} that the router did not send there")
    slots = here.to(torch.int64).argmax(-1)
    has_record = cols["has_record"].reshape(n).bool()
    fc2_has = torch.gather(cols["fc2_found"].bool(), 1, slots[:, None]).reshape(n)
    fc1 = fc2 = None
    if spec.guide is not None:
        fc1 = spec.guide.from_row_bytes(cols["fc1"], spec.hidden, (n,))
        per_slot = cols["fc2"].reshape(n, spec.top_k, cols["fc2"].shape[1] // spec.top_k)
        width = per_slot.shape[-1]
        chosen = torch.gather(per_slot, 1, slots[:, None, None].expand(-1, 1, width)).reshape(n, width)
        fc2 = spec.guide.from_row_bytes(chosen, spec.inter, (n,))
    return ExpertRows(positions, slots, has_record, fc1, fc2, fc2_has)


def follow_dispatch(dispatcher, payload: torch.Tensor) -> torch.Tensor:
    """Replay, on `payload` [local tokens, P], the moves the dispatcher just made with the hidden states;
    returns [rows of the local experts, P] in the order the experts receive them."""
    with torch.no_grad():
        if isinstance(dispatcher, MoEAllGatherTokenDispatcher):
            if dispatcher.tp_size > 1 or dispatcher.ep_size > 1:
                payload = gather_from_sequence_parallel_region(payload, group=dispatcher.tp_ep_group)
            local_map = dispatcher.local_map
            out, *_ = permute(payload, local_map, num_out_tokens=int(local_map.sum()), fused=False)
            return out
        if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
            if dispatcher.drop_and_pad or dispatcher.config.moe_router_padding_for_quantization:
                raise NotImplementedError("trace_megatron: token dropping / padded routing is not supported")
            out, *_ = permute(payload, dispatcher.routing_map, num_out_tokens=dispatcher.num_out_tokens, fused=False)
            if dispatcher.ep_size > 1:
                out = all_to_all(dispatcher.ep_group, out, dispatcher.output_splits, dispatcher.input_splits)
            if dispatcher.tp_size > 1:
                sizes = None if dispatcher.output_splits_tp is None else dispatcher.output_splits_tp.tolist()
                out = gather_from_sequence_parallel_region(out, group=dispatcher.tp_group, output_split_sizes=sizes)
            if dispatcher.num_local_experts > 1:
                out, _ = sort_chunks_by_idxs(
                    out, dispatcher.num_global_tokens_per_local_expert.ravel(), dispatcher.sort_input_by_local_experts, fused=False
                )
            return out
    raise NotImplementedError(
        f"trace_megatron follows the allgather and alltoall token dispatchers, not {type(dispatcher).__name__}"
    )
