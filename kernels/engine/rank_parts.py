"""One request's record from the parts its tensor- and pipeline-parallel ranks captured (docs/record-format.md).

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
Pipeline parallel: each stage's TP ranks hold the layers of that stage (`layers` in their parts), as
above; the record takes each layer from the one stage that holds it, and the weights digest is rebuilt
from every stage's layer digests (`layer_digests`), so it is a single-rank engine's.
A part (of a rank or a stage) missing or present twice, a layer held by two stages or none, ranks that
disagree on a replicated site, or rows of the wrong width are refused with a ValueError that names the
rank (and stage) and the site: never a record with a hole.

A part travels as a plain dict (msgpack-safe): rank, tp_size, pp_rank, pp_size, num_tokens, weights,
shape, config, `tensors` (safetensors bytes of the rank's rows), `digests` (of its replicated sites),
`experts` (EP), `layers` and `layer_digests` (PP).
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
from ..weight_digest import model_digest
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
              weights: tuple = (None, None), experts: list[int] | None = None, pp_rank: int = 0,
              pp_size: int = 1, layers: list[int] | None = None, layer_digests: dict | None = None) -> dict:
    """This rank's part of one request's record. `chunks`: the capture's (num_rows, sites, routing)
    chunks in token order (RequestCapture.chunks). `rank`: the rank in its tensor-parallel group.
    `experts`: under expert parallelism, the global ids of the experts this rank holds (its fc2 rows
    count only for the pairs routed to them). Pipeline parallel: `pp_rank` / `pp_size` its stage,
    `layers` the decoder layers the stage holds, `layer_digests` the expert-weights digest of each of
    its layers ({layer: digest}, behind `weights`' digest) so the driver can name the whole model's."""
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
        "rank": int(rank), "tp_size": int(tp_size), "pp_rank": int(pp_rank), "pp_size": int(pp_size),
        "num_tokens": int(num_rows), "weights": list(weights), "shape": shape.to_dict(), "config": config.to_json(),
        "tensors": st_save(tensors) if tensors else b"", "digests": digests,
        "experts": None if experts is None else [int(e) for e in experts],
        "layers": None if layers is None else [int(x) for x in layers],
        "layer_digests": None if layer_digests is None else {str(k): v for k, v in layer_digests.items()},
    }


def _expected_sites(shape: ModelShape, config: TraceConfig, layers=None) -> list[tuple[int, str]]:
    modes = config.layer_modes(shape.num_layers)
    return [(layer, site) for layer in range(shape.num_layers) if modes[layer] is not None
            and (layers is None or layer in layers) for site in shape.layer_sites(layer)]


def _label(stage: int, rank: int, pp_size: int) -> str:
    return f"rank {rank}" if pp_size == 1 else f"pipeline stage {stage} rank {rank}"


def _by_rank(parts: list[dict], tp_size: int, what: str, where: str, stage: int = 0, pp_size: int = 1) -> dict[int, dict]:
    """{rank: part}; refuses a rank missing or present twice, naming it and `what`."""
    seen: dict[int, dict] = {}
    for p in parts:
        r = int(p["rank"])
        if not 0 <= r < tp_size:
            raise ValueError(f"{where}: {what}: a part from {_label(stage, r, pp_size)}, outside tensor_parallel_size={tp_size}")
        if r in seen:
            raise ValueError(f"{where}: {what}: the part of {_label(stage, r, pp_size)} is present twice")
        seen[r] = p
    missing = [r for r in range(tp_size) if r not in seen]
    if missing:
        raise ValueError(f"{where}: {what}: no part from {_label(stage, missing[0], pp_size)} (tensor_parallel_size={tp_size})")
    return seen


def _by_stage(parts: list[dict], pp_size: int, tp_size: int, where: str) -> dict[int, dict[int, dict]]:
    """{stage: {rank: part}}; refuses a stage (or a rank of one) missing or present twice."""
    stages: dict[int, list[dict]] = {}
    for p in parts:
        s = int(p.get("pp_rank", 0))
        if not 0 <= s < pp_size:
            raise ValueError(f"{where}: the request: a part from pipeline stage {s}, outside pipeline_parallel_size={pp_size}")
        stages.setdefault(s, []).append(p)
    missing = [s for s in range(pp_size) if s not in stages]
    if missing:
        raise ValueError(f"{where}: the request: no part from pipeline stage {missing[0]} (pipeline_parallel_size={pp_size})")
    return {s: _by_rank(stages[s], tp_size, "the request", where, s, pp_size) for s in range(pp_size)}


def _stage_layers(stages: dict[int, dict[int, dict]], num_layers: int, where: str) -> dict[int, set[int]]:
    """The decoder layers of each pipeline stage; each layer held by exactly one stage."""
    pp_size = len(stages)
    out, holder = {}, {}
    for s, ranks in stages.items():
        lists = {r: p.get("layers") for r, p in ranks.items()}
        if lists[0] is None and pp_size == 1:
            out[s] = set(range(num_layers))
            continue
        for r, lst in lists.items():
            if lst is None:
                raise ValueError(f"{where}: {_label(s, r, pp_size)}: its part does not say which layers it holds (pipeline parallel)")
            if sorted(lst) != sorted(lists[0]):
                raise ValueError(f"{where}: {_label(s, r, pp_size)}: holds layers {sorted(lst)}, rank 0 of its stage {sorted(lists[0])}")
        out[s] = set(int(x) for x in lists[0])
        for layer in sorted(out[s]):
            if not 0 <= layer < num_layers:
                raise ValueError(f"{where}: pipeline stage {s}: layer {layer} is outside the model's {num_layers} layers")
            if layer in holder:
                raise ValueError(f"{where}: layer {layer} is present twice (pipeline stage {holder[layer]} and stage {s})")
            holder[layer] = s
    missing = [x for x in range(num_layers) if x not in holder] if pp_size > 1 else []
    if missing:
        raise ValueError(f"{where}: layer {missing[0]}: no pipeline stage's part holds it")
    return out


def _stage_weights(stages: dict[int, dict[int, dict]], where: str) -> tuple:
    """(weights version, digest) of the whole model. One stage: rank 0's. Several: the lowest version
    of any stage (as one engine's least-updated layer decides), the digest rebuilt from every stage's
    layer digests (`trace_kernels.weight_digest.model_digest`, what a single-rank engine computes)."""
    pp_size = len(stages)
    for s, ranks in stages.items():
        for r, p in ranks.items():
            if list(p["weights"]) != list(ranks[0]["weights"]):
                raise ValueError(f"{where}: {_label(s, r, pp_size)}: weights {p['weights']} differ from rank 0's "
                                 f"{ranks[0]['weights']}")
    if pp_size == 1:
        return tuple(stages[0][0]["weights"])
    versions = [stages[s][0]["weights"][0] for s in range(pp_size)]
    version = None if any(v is None for v in versions) else min(versions)
    merged = {}
    for s in range(pp_size):
        head = stages[s][0]
        if head["weights"][1] is None:
            return version, None  # unquantized expert weights (ablation): no digest anywhere
        layers = head.get("layer_digests")
        if layers is None:
            raise ValueError(f"{where}: pipeline stage {s}: its part carries no layer digests (pipeline parallel)")
        layers = {int(k): v for k, v in layers.items()}
        if model_digest(layers) != head["weights"][1]:
            raise ValueError(f"{where}: pipeline stage {s}: its layer digests do not give its weights digest")
        merged.update(layers)
    return version, model_digest(merged)


def assemble_rank_parts(parts: list[dict], *, identity: dict | None = None, where: str = "record"):
    """The single-rank-layout GuidanceRecord of one request from its ranks' parts (TP ranks of every
    pipeline stage; see module doc). Returns (record, seconds spent assembling)."""
    t0 = time.perf_counter()
    if not parts:
        raise ValueError(f"{where}: no rank parts")
    tp_size, pp_size = int(parts[0]["tp_size"]), int(parts[0].get("pp_size", 1))
    stages = _by_stage(parts, pp_size, tp_size, where)
    head = stages[0][0]
    for s, ranks in stages.items():
        for r, p in ranks.items():
            for field in ("tp_size", "pp_size", "num_tokens", "shape", "config"):
                if p.get(field, 1) != head.get(field, 1):
                    raise ValueError(f"{where}: {_label(s, r, pp_size)}: {field} {p.get(field)!r} differs from "
                                     f"{_label(0, 0, pp_size)}'s {head.get(field)!r}")
    weights = _stage_weights(stages, where)
    shape = ModelShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in head["shape"].items()})
    config = TraceConfig.from_dict(json.loads(head["config"]))
    T = int(head["num_tokens"])
    routing, sites = {}, {}
    for s, layers in _stage_layers(stages, shape.num_layers, where).items():
        _assemble_stage(stages[s], layers, shape, config, routing, sites, where, s, pp_size)
    for (layer, site), q in sites.items():
        if q.codes.shape[0] != T:
            raise ValueError(f"{where}: layer {layer} {site}: {q.codes.shape[0]} rows, the parts say {T} tokens")
    record = assemble_record(shape, config, [(routing, sites)], weights=weights, identity=identity)
    return record, time.perf_counter() - t0


def _assemble_stage(ranks: dict[int, dict], layers: set[int], shape: ModelShape, config: TraceConfig,
                    routing: dict, sites: dict, where: str, stage: int, pp_size: int) -> None:
    """The rows of one pipeline stage's layers from its TP ranks' parts, into `routing` and `sites`."""
    tp_size = len(ranks)
    label = lambda r: _label(stage, r, pp_size)  # noqa: E731
    tensors = {r: (st_load(p["tensors"]) if p["tensors"] else {}) for r, p in ranks.items()}
    owner = _expert_owners(ranks, shape.num_experts, where, label)
    for layer in shape.moe_layer_list():
        if layer not in layers:
            continue
        key = f"{layer}.routing"
        _check_replicated(ranks, key, where, f"layer {layer} routing", label)
        routing[layer] = _take(tensors[0], key, label(0), where, f"layer {layer} routing")
        _check_sent(ranks[0], key, [routing[layer]], where, f"layer {layer} routing", label(0))
    expected_sites = _expected_sites(shape, config, layers)
    for layer, site in expected_sites:
        key = site_key(layer, site)
        what = f"layer {layer} {site}"
        if site in REPLICATED_SITES:
            _check_replicated(ranks, key, where, what, label)
            rows = [_take(tensors[0], f"{key}.{f}", label(0), where, what) for f in ("codes", "scales", "amax")]
            _check_sent(ranks[0], key, rows, where, what, label(0))
            sites[(layer, site)] = NVFP4Tensor(*rows)
            continue
        per_rank = [[_take(tensors[r], f"{key}.{f}", label(r), where, what) for f in ("codes", "scales", "amax")]
                    for r in range(tp_size)]
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
                        f"{where}: {label(r)}: {what}: row amax differs from rank 0's (the ranks must all-reduce "
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
        expected = {f"{site_key(lay, s)}.{f}" for lay, s in expected_sites
                    if r == 0 or s not in REPLICATED_SITES for f in ("codes", "scales", "amax")}
        expected |= {f"{layer}.routing" for layer in shape.moe_layer_list() if layer in layers} if r == 0 else set()
        extra = sorted(set(t) - expected)
        if extra:
            raise ValueError(f"{where}: {label(r)}: sent {extra[0]!r}, which no rank of this layout holds")


def _expert_owners(ranks: dict[int, dict], num_experts: int, where: str, label=lambda r: f"rank {r}") -> torch.Tensor | None:
    """Under expert parallelism: int64 [num_experts], the rank holding each expert (None otherwise).
    An expert held by no rank, or by two, is refused naming it."""
    held = {r: p.get("experts") for r, p in ranks.items()}
    if all(v is None for v in held.values()):
        return None
    owner = torch.full((num_experts,), -1, dtype=torch.int64)
    for r, experts in sorted(held.items()):
        if experts is None:
            raise ValueError(f"{where}: {label(r)}: its part does not say which experts it holds (expert parallel)")
        for e in experts:
            if owner[e] >= 0:
                raise ValueError(f"{where}: moe_fc2_in: expert {e} is present twice ({label(int(owner[e]))} and {label(r)})")
            owner[e] = r
    missing = (owner < 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"{where}: moe_fc2_in: expert {missing[0]} is held by no rank's part")
    return owner


def _take(tensors: dict, key: str, who: str, where: str, what: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"{where}: {who}: {what}: missing from its part")
    return tensors[key]


def _check_replicated(ranks: dict[int, dict], key: str, where: str, what: str, label=lambda r: f"rank {r}") -> None:
    ref = ranks[0]["digests"].get(key)
    if ref is None:
        raise ValueError(f"{where}: {label(0)}: {what}: missing from its part")
    for r, p in ranks.items():
        d = p["digests"].get(key)
        if d is None:
            raise ValueError(f"{where}: {label(r)}: {what}: missing from its part")
        if d != ref:
            raise ValueError(
                f"{where}: {label(r)}: {what} differs from rank 0's (digest {d[:12]} vs {ref[:12]}): the ranks "
                "must compute the same rows there"
            )


def _check_sent(part: dict, key: str, rows: list, where: str, what: str, who: str = "rank 0") -> None:
    if _digest(*rows) != part["digests"][key]:
        raise ValueError(f"{where}: {who}: {what}: its rows do not match the digest it sent")
