"""One request's record from the parts its tensor-parallel ranks captured (docs/record-format.md).

A record is a property of a request, not of a rank: whatever parallel layout computed it, it is laid
out as a single-rank record. Per site, what one TP rank holds:
  moe_fc1_in, kv_latent, routing  the same rows on every rank (the hidden states after the
                                  all-reduce; MLA's latent is not split by head): rank 0 sends them,
                                  every rank sends their digest, and the ranks must agree
  moe_fc2_in                      the rank's slice of the intermediate dimension (whole 16-element
                                  blocks); the row amax was all-reduced (max) before quantizing, so
                                  every rank holds the same amax per row
  k, v                            the rank's KV heads (heads r * H/n .. (r+1) * H/n - 1)
  moe_fc2_in, expert parallel     whole rows, but a rank computes only the (token, slot) pairs routed
                                  to the experts it holds (`experts` in its part): each pair's row is
                                  taken from its expert's rank, which the routing ids say
A part missing or present twice, ranks that disagree on a replicated site, or rows of the wrong
width are refused with a ValueError that names the rank and the site: never a record with a hole.

A part travels as a plain dict (msgpack-safe): rank, tp_size, num_tokens, weights, shape, config,
`tensors` (safetensors bytes of the rank's rows) and `digests` (of its replicated sites).
"""

import hashlib
import json
import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..config import TraceConfig
from ..model_shape import ModelShape
from ..tensor import NVFP4Tensor
from .captured_rows import concat_chunks
from .records import assemble_record

REPLICATED_SITES = ("moe_fc1_in", "kv_latent")
INTERMEDIATE_SPLIT_SITES = ("moe_fc2_in",)
HEAD_SPLIT_SITES = ("k", "v")


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def site_key(layer: int, site: str) -> str:
    return f"{layer}.{site}"


def rank_part(chunks, num_rows: int, *, rank: int, tp_size: int, shape: ModelShape, config: TraceConfig,
              weights: tuple = (None, None), experts: list[int] | None = None) -> dict:
    """This rank's part of one request's record. `chunks`: the capture's (num_rows, sites, routing)
    chunks in token order (RequestCapture.chunks). `experts`: under expert parallelism, the global ids
    of the experts this rank holds (its fc2 rows count only for the pairs routed to them)."""
    sites, routing = concat_chunks(chunks, num_rows)
    tensors, digests = {}, {}
    for layer, ids in routing.items():
        key = f"{layer}.routing"
        digests[key] = _digest(ids)
        if rank == 0:
            tensors[key] = ids.contiguous()
    for (layer, site), q in sites.items():
        key = site_key(layer, site)
        if site in REPLICATED_SITES:
            digests[key] = _digest(q.codes, q.scales, q.global_amax)
            if rank != 0:
                continue
        tensors[f"{key}.codes"] = q.codes.contiguous()
        tensors[f"{key}.scales"] = q.scales.contiguous()
        tensors[f"{key}.amax"] = q.global_amax.to(torch.float32).contiguous()
    return {
        "rank": int(rank), "tp_size": int(tp_size), "num_tokens": int(num_rows),
        "weights": list(weights), "shape": shape.to_dict(), "config": config.to_json(),
        "tensors": st_save(tensors) if tensors else b"", "digests": digests,
        "experts": None if experts is None else [int(e) for e in experts],
    }


def _expected_sites(shape: ModelShape, config: TraceConfig) -> list[tuple[int, str]]:
    modes = config.layer_modes(shape.num_layers)
    return [(layer, site) for layer in range(shape.num_layers) if modes[layer] is not None
            for site in shape.layer_sites(layer)]


def _by_rank(parts: list[dict], tp_size: int, what: str, where: str) -> dict[int, dict]:
    """{rank: part}; refuses a rank missing or present twice, naming it and `what`."""
    seen: dict[int, dict] = {}
    for p in parts:
        r = int(p["rank"])
        if not 0 <= r < tp_size:
            raise ValueError(f"{where}: {what}: a part from rank {r}, outside tensor_parallel_size={tp_size}")
        if r in seen:
            raise ValueError(f"{where}: {what}: the part of rank {r} is present twice")
        seen[r] = p
    missing = [r for r in range(tp_size) if r not in seen]
    if missing:
        raise ValueError(f"{where}: {what}: no part from rank {missing[0]} (tensor_parallel_size={tp_size})")
    return seen


def assemble_rank_parts(parts: list[dict], *, identity: dict | None = None, where: str = "record"):
    """The single-rank-layout GuidanceRecord of one request from its TP ranks' parts (see module doc).
    Returns (record, seconds spent assembling)."""
    t0 = time.perf_counter()
    if not parts:
        raise ValueError(f"{where}: no rank parts")
    tp_size = int(parts[0]["tp_size"])
    ranks = _by_rank(parts, tp_size, "the request", where)
    head = ranks[0]
    for r, p in ranks.items():
        for field in ("tp_size", "num_tokens", "shape", "config"):
            if p[field] != head[field]:
                raise ValueError(f"{where}: rank {r}: {field} {p[field]!r} differs from rank 0's {head[field]!r}")
        if list(p["weights"]) != list(head["weights"]):
            raise ValueError(f"{where}: rank {r}: weights {p['weights']} differ from rank 0's {head['weights']}")
    shape = ModelShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in head["shape"].items()})
    config = TraceConfig.from_dict(json.loads(head["config"]))
    T = int(head["num_tokens"])
    tensors = {r: (st_load(p["tensors"]) if p["tensors"] else {}) for r, p in ranks.items()}

    owner = _expert_owners(ranks, shape.num_experts, where)
    routing = {}
    for layer in shape.moe_layer_list():
        key = f"{layer}.routing"
        _check_replicated(ranks, key, where, f"layer {layer} routing")
        routing[layer] = _take(tensors[0], key, 0, where, f"layer {layer} routing")
        _check_sent(ranks[0], key, [routing[layer]], where, f"layer {layer} routing")
    sites = {}
    for layer, site in _expected_sites(shape, config):
        key = site_key(layer, site)
        what = f"layer {layer} {site}"
        if site in REPLICATED_SITES:
            _check_replicated(ranks, key, where, what)
            rows = [_take(tensors[0], f"{key}.{f}", 0, where, what) for f in ("codes", "scales", "amax")]
            _check_sent(ranks[0], key, rows, where, what)
            sites[(layer, site)] = NVFP4Tensor(*rows)
            continue
        per_rank = [[_take(tensors[r], f"{key}.{f}", r, where, what) for f in ("codes", "scales", "amax")] for r in range(tp_size)]
        if site in INTERMEDIATE_SPLIT_SITES and owner is not None:
            # Expert parallel: each (token, slot) row comes from the rank that holds its expert.
            who = owner[routing[layer].long()]  # [T, k]
            stacked = [torch.stack([p[i] for p in per_rank]) for i in range(3)]  # [R, T, k, ...]
            pick = [s_.gather(0, who.view(1, *who.shape, *([1] * (s_.dim() - 3))).expand(1, *s_.shape[1:]))[0]
                    for s_ in stacked]
            sites[(layer, site)] = NVFP4Tensor(*pick)
        elif site in INTERMEDIATE_SPLIT_SITES:
            amax0 = per_rank[0][2]
            for r in range(1, tp_size):
                if not torch.equal(per_rank[r][2], amax0):
                    raise ValueError(
                        f"{where}: rank {r}: {what}: row amax differs from rank 0's (the ranks must all-reduce "
                        "the amax of rows they split before quantizing)"
                    )
            codes = torch.cat([p[0] for p in per_rank], dim=-1)
            scales = torch.cat([p[1] for p in per_rank], dim=-1)
            sites[(layer, site)] = NVFP4Tensor(codes, scales, amax0)
        elif site in HEAD_SPLIT_SITES:
            sites[(layer, site)] = NVFP4Tensor(*(torch.cat([p[i] for p in per_rank], dim=1) for i in range(3)))
        else:
            raise ValueError(f"{where}: {what}: no tensor-parallel layout known for site {site!r}")
        got = tuple(sites[(layer, site)].shape[1:])
        if got != shape.row_shape(site):
            raise ValueError(f"{where}: {what}: the ranks' parts give rows of shape {got}, the model {shape.row_shape(site)}")
    for r, t in tensors.items():
        expected = {f"{site_key(lay, s)}.{f}" for lay, s in _expected_sites(shape, config)
                    if r == 0 or s not in REPLICATED_SITES for f in ("codes", "scales", "amax")}
        expected |= {f"{layer}.routing" for layer in shape.moe_layer_list()} if r == 0 else set()
        extra = sorted(set(t) - expected)
        if extra:
            raise ValueError(f"{where}: rank {r}: sent {extra[0]!r}, which no rank of this layout holds")
    for (layer, site), q in sites.items():
        if q.codes.shape[0] != T:
            raise ValueError(f"{where}: layer {layer} {site}: {q.codes.shape[0]} rows, the parts say {T} tokens")
    record = assemble_record(shape, config, [(routing, sites)], weights=tuple(head["weights"]), identity=identity)
    return record, time.perf_counter() - t0


def _expert_owners(ranks: dict[int, dict], num_experts: int, where: str) -> torch.Tensor | None:
    """Under expert parallelism: int64 [num_experts], the rank holding each expert (None otherwise).
    An expert held by no rank, or by two, is refused naming it."""
    held = {r: p.get("experts") for r, p in ranks.items()}
    if all(v is None for v in held.values()):
        return None
    owner = torch.full((num_experts,), -1, dtype=torch.int64)
    for r, experts in sorted(held.items()):
        if experts is None:
            raise ValueError(f"{where}: rank {r}: its part does not say which experts it holds (expert parallel)")
        for e in experts:
            if owner[e] >= 0:
                raise ValueError(f"{where}: moe_fc2_in: expert {e} is present twice (rank {int(owner[e])} and rank {r})")
            owner[e] = r
    missing = (owner < 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"{where}: moe_fc2_in: expert {missing[0]} is held by no rank's part")
    return owner


def _take(tensors: dict, key: str, rank: int, where: str, what: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"{where}: rank {rank}: {what}: missing from its part")
    return tensors[key]


def _check_replicated(ranks: dict[int, dict], key: str, where: str, what: str) -> None:
    ref = ranks[0]["digests"].get(key)
    if ref is None:
        raise ValueError(f"{where}: rank 0: {what}: missing from its part")
    for r, p in ranks.items():
        d = p["digests"].get(key)
        if d is None:
            raise ValueError(f"{where}: rank {r}: {what}: missing from its part")
        if d != ref:
            raise ValueError(
                f"{where}: rank {r}: {what} differs from rank 0's (digest {d[:12]} vs {ref[:12]}): the ranks "
                "must compute the same rows there"
            )


def _check_sent(part: dict, key: str, rows: list, where: str, what: str) -> None:
    if _digest(*rows) != part["digests"][key]:
        raise ValueError(f"{where}: rank 0: {what}: its rows do not match the digest it sent")
