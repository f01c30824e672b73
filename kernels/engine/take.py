"""Every record of one take built together: per layer and site, one native encoder call over all the
take's requests (their rows back to back), instead of one call per record and site.

Why: a take of 16 records on the tiny model is 256 sparse sites. Built one record at a time
(`assemble_record`), each site paid ~90 us of Python around a ~10 us kernel: the encoder's checks and
tensor conversions, the audit's blob, the builder's per-`add` checks and concatenations. Here those
run once per layer and site for the whole take, and each record only gets its slices. The records are
byte for byte what `assemble_record` builds (tests/kernels/test_take.py compares every byte).

Only the common case is batched: every guided layer sparse, the record encoder native, and requests
whose rows joined into one tensor per key of the expected shapes (what vLLM's capture store holds).
A request that is not (rows that do not join, a missing site, an empty record, a bad identity) is
built alone by `assemble_record`, which names what is wrong with it; on the native path that is
counted in cpu_native.FALLBACKS ("per_record:take"), never silent.
"""

import math

import numpy as np
import torch

from .. import cpu_native, envs
from ..guides.sparse.audit import audit_blob_numpy
from ..guides.sparse.rates import layer_rates, segment
from ..guides.sparse.wire import version_for
from ..records import GuidanceRecord, RecordBuilder
from ..records.layout import packs_routing, routing_name, tensor_name
from ..records.routing import id_bits
from ..tensor import NVFP4Tensor
from .captured_rows import StepChunks
from .host_arena import gather_arena_chunks
from .step_gather import gather_step_chunks


def batches(shape, config) -> bool:
    """Whether a take under `config` is built in batches: every guided layer sparse (unguided layers keep
    their routing ids as int16 rows), and the record encoder native (TRACE_FP4_RECORD_BACKEND=native, or
    "auto" under TRACE_FP4_CPU_BACKEND=native: what `sparse_parts.record_backend` resolves for host rows)."""
    modes = config.layer_modes(shape.num_layers)
    if any(m not in (None, "sparse") for m in modes):
        return False
    choice = envs.TRACE_FP4_RECORD_BACKEND
    return choice == "native" or (choice == "auto" and cpu_native.enabled())


def assemble_take(shape, config, requests, joiner) -> list:
    """`requests`: [(chunks, weights, identity)] as `assemble_record` takes them (chunks in token order,
    (version, digest), RecordBuilder.set_identity keywords or None); `joiner`: the take's ChunkJoiner,
    every request announced. Returns one entry per request: its GuidanceRecord, or None where it was
    not batched (the caller builds it with `assemble_record`, which raises what is wrong with it)."""
    modes = config.layer_modes(shape.num_layers)
    moe = [layer for layer in range(shape.num_layers) if shape.has_moe(layer)]
    keys = [(layer, site) for layer in range(shape.num_layers) for site in shape.layer_sites(layer)]
    guided = [(layer, site) for layer, site in keys if modes[layer] is not None]
    out: list = [None] * len(requests)
    requests = [(chunks if isinstance(chunks, StepChunks) else list(chunks), weights, identity)
                for chunks, weights, identity in requests]
    batch = _gathered(shape, moe, keys, requests, joiner) or _joined(shape, moe, keys, requests, joiner)
    if batch is None:
        return _counted(out)
    chosen, tokens, routing, sites = batch
    idents = [_identity(shape, config, requests[i], int(tokens[j + 1] - tokens[j])) for j, i in enumerate(chosen)]
    if not (_routing_in_range(shape, routing) and _rates_fit(shape, config, guided)):
        return _counted(out)
    tensors = [{} for _ in chosen]
    audits = _audit_rows(config, guided, idents, tokens)
    for layer in range(shape.num_layers):
        if layer in moe:
            packed = packs_routing(modes[layer])
            ids = routing[layer]
            for t, v in zip(tensors, _pack_routing(ids, tokens, shape.num_experts) if packed else _int16(ids, tokens)):
                t[routing_name(layer, packed)] = v
        if modes[layer] is None:
            continue
        for site in shape.layer_sites(layer):
            _encode_site(config, layer, site, sites[(layer, site)], idents, tokens, tensors, audits.get((layer, site)))
    config_text = (config, config.to_json())  # one metadata text for every record of the take
    for i, ident, t in zip(chosen, idents, tensors):
        if ident is not None:
            out[i] = GuidanceRecord(shape, config, ident.num_tokens, modes, t, ident)
            out[i].config_text = config_text
    return _counted(out)


def _identity(shape, config, request, T: int):
    """The record identity of a request of T token rows (RecordBuilder's), or None where its identity
    does not fit its rows: that request is then left to the per-record build, which raises why."""
    _, weights, identity = request
    builder = RecordBuilder(shape, config, weights_version=weights[0], weights_digest=weights[1])
    try:
        if identity:
            builder.set_identity(**identity)
        return builder._build_identity(T)
    except ValueError:
        return None


def _counted(out: list) -> list:
    """`out`, each request left to the per-record path counted as a fallback of the native take."""
    missed = sum(r is None for r in out)
    if missed:
        cpu_native.FALLBACKS["per_record:take"] += missed
    return out


def _gathered(shape, moe, keys, requests, joiner):
    """(every request's index, token offsets, {layer: ids}, {(layer, site): rows}) with each key's rows of
    all requests back to back, straight from the joiner's one gather per key (`ChunkJoiner.gather`: the
    requests of a take that ran in the same steps), or None when it does not apply or a key's rows do
    not fit (then each request is joined on its own: `_joined`)."""
    if all(isinstance(c, StepChunks) for c, _, _ in requests):  # the capture store's steps, by their layout
        # The native CPU engine's host arena: each key's rows of every request read by one index a chunk
        # (host_arena.py), the rows the gathers below give.
        routing, sites = gather_arena_chunks([c for c, _, _ in requests]) or (None, None)
        if sites is None:
            routing = joiner.gather_layouts([(c.routing, c.ranges) for c, _, _ in requests])
            sites = joiner.gather_layouts([(c.sites, c.ranges) for c, _, _ in requests]) if routing is not None else None
        if sites is None:  # requests that ran in different steps (ended at different lengths): one gather still
            routing, sites = gather_step_chunks([c for c, _, _ in requests]) or (None, None)
        per = [c.rows() for c, _, _ in requests]  # each request's token rows
    else:
        routing = joiner.gather([[r for r, _ in c] for c, _, _ in requests])
        sites = joiner.gather([[s for _, s in c] for c, _, _ in requests]) if routing is not None else None
        per = [sum((m.stop - m.start) for m, _ in c) for c, _, _ in requests] if sites is not None else None
    if sites is None:
        return None
    tokens = np.cumsum([0] + per)
    if not tokens[-1] or 0 in per or not _fits(shape, moe, keys, routing, sites, int(tokens[-1])):
        return None
    return list(range(len(requests))), tokens, routing, sites


def _joined(shape, moe, keys, requests, joiner):
    """`_gathered`'s form from each request's own join: the requests whose rows fit a batched build,
    each key's rows concatenated; None when none does."""
    chosen, per, joined = [], [], []
    for i, (chunks, _, _) in enumerate(requests):
        if not chunks:
            continue
        routing = joiner.join(r for r, _ in chunks)
        sites = joiner.join(s for _, s in chunks)
        first = routing.get(moe[0]) if moe else None
        T = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() == 2 else 0
        if T and _fits(shape, moe, keys, routing, sites, T):
            chosen.append(i)
            per.append(T)
            joined.append((routing, sites))
    if not chosen:
        return None
    routing = {layer: torch.cat([r[layer] for r, _ in joined]) for layer in moe}
    sites = {k: NVFP4Tensor(*(torch.cat([getattr(s[k], f) for _, s in joined]) for f in ("codes", "scales", "global_amax")))
             for k in keys}
    return chosen, np.cumsum([0] + per), routing, sites


def _fits(shape, moe, keys, routing, sites, T: int) -> bool:
    """Whether joined rows of T tokens fit a batched build: every MoE layer's routing one [T, top_k]
    tensor, every site's rows one NVFP4Tensor [T, *row] with a float32 amax per row, no other keys
    (otherwise the per-record build checks them and names what does not fit)."""
    if len(routing) != len(moe) or len(sites) != len(keys) or not moe:
        return False
    for layer in moe:
        ids = routing.get(layer)
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (T, shape.top_k) or ids.device.type != "cpu":
            return False
    for layer, site in keys:
        q = sites.get((layer, site))
        if not isinstance(q, NVFP4Tensor) or q.codes.device.type != "cpu":
            return False
        row = shape.row_shape(site)
        if (tuple(q.codes.shape) != (T, *row[:-1], row[-1] // 2) or tuple(q.scales.shape) != (T, *row[:-1], row[-1] // 16)
                or tuple(q.global_amax.shape) != (T, *row[:-1]) or q.global_amax.dtype != torch.float32
                or q.codes.dtype != torch.uint8 or q.scales.dtype != torch.uint8):
            return False
    return True


def _routing_in_range(shape, routing) -> bool:
    """Every routing id of the batch in [0, num_experts) (the builder's check, once for all records)."""
    return all(int(ids.min()) >= 0 and int(ids.max()) < shape.num_experts for ids in routing.values() if ids.numel())


def _rates_fit(shape, config, guided) -> bool:
    """Every guided site's scale rate within its segment's blocks (the encoder refuses more: the
    per-record build raises that refusal)."""
    for layer, site in guided:
        K = shape.row_shape(site)[-1]
        if layer_rates(config, layer, site, K).scale_bits > segment(K) // 16:
            return False
    return True


def _int16(ids: torch.Tensor, tokens: np.ndarray) -> list:
    """Each record's routing ids as int16 rows (an unguided layer's: the builder's concatenation)."""
    flat = ids.to(torch.int16)
    return [flat[tokens[i] : tokens[i + 1]] for i in range(len(tokens) - 1)]


def _pack_routing(ids: torch.Tensor, tokens: np.ndarray, num_experts: int) -> list:
    """Each record's routing ids bit-packed as records.routing.pack_routing writes them (b bits per id, LSB
    first, zero-padded to a byte), the bits of every record made at once."""
    b = id_bits(num_experts)
    bits = ((ids.to(torch.int64).numpy().reshape(-1, 1) >> np.arange(b)) & 1).astype(np.uint8).reshape(-1)
    per_token = ids.shape[1] * b
    return [torch.from_numpy(np.packbits(bits[tokens[i] * per_token : tokens[i + 1] * per_token], bitorder="little"))
            for i in range(len(tokens) - 1)]


def _audit_rows(config, guided: list, idents: list, tokens: np.ndarray) -> dict:
    """{(layer, site): each record's audited token rows (None where its identity does not fit)}: every
    draw of the take at once (cpu_native.audit_draw: the seeds' generators run side by side), the same
    rows as sparse_parts.encode_site's `audit_rows` per record and site."""
    if config.sparse_audit <= 0:
        return {}
    from ..cpu_native import audit_draw

    live = [(i, ident.token_digest) for i, ident in enumerate(idents) if ident is not None]
    lens = np.diff(tokens).tolist()  # each record's token rows, as ints (not a numpy scalar per draw)
    draws = [(lens[i], layer, site, digest) for layer, site in guided for i, digest in live]
    rows = audit_draw.row_lists(draws, config.sparse_audit)
    out = {}
    for k, key in enumerate(guided):  # the draws are by site, then by record: each site's are one slice
        per = out[key] = [None] * len(idents)
        for (i, _), r in zip(live, rows[k * len(live) : (k + 1) * len(live)]):
            per[i] = r
    return out


def _encode_site(config, layer: int, site: str, q: NVFP4Tensor, idents: list, tokens: np.ndarray, tensors: list,
                 audits: list | None) -> None:
    """Every batched record's tensors of one sparse site (`q`: their rows back to back, record i's tokens
    [tokens[i], tokens[i + 1])): its payload (one kernel call for all) and its audit (`audits`: each
    record's audited rows, `_audit_rows`)."""
    from ..cpu_native import sparse_encode

    K = q.codes.shape[-1] * 2
    inner = math.prod(q.codes.shape[1:-1])
    rates = layer_rates(config, layer, site, K)
    payload, starts = sparse_encode.encode_many(q.codes, q.scales, q.global_amax, tokens * inner, K, segment(K), rates,
                                                version_for(rates))
    # the site's tensor names, the same in every record (made once, not per record)
    payload_name, audit_name = tensor_name(layer, site, "sparse"), tensor_name(layer, site, "audit")
    # every record's payload a view of the one array, made by one split (not a numpy slice and a
    # from_numpy per record)
    payloads = torch.from_numpy(payload).split(np.diff(starts).tolist())
    for t, ident, p in zip(tensors, idents, payloads):
        if ident is not None:  # a record not built here (its identity does not fit): its payload is dropped
            t[payload_name] = p
    if config.sparse_audit <= 0:
        return
    # sparse_parts.encode_site's audit: the same rows (audit_rows), the same blob (audit_parts); a record
    # with no row drawn (most of a site's records at the default fraction) gets an empty uint8 tensor,
    # one shared by the site's records (~200 of them a take: a torch.empty each cost ~1 us)
    blobs = _audit_blobs(q.codes, tokens, audits)
    empty = torch.empty(0, dtype=torch.uint8)
    for t, ident, blob in zip(tensors, idents, blobs):
        if ident is not None:
            t[audit_name] = empty if blob is None else blob


def _audit_blobs(codes: torch.Tensor, tokens: np.ndarray, audits: list) -> list:
    """Each record's audit blob (`audit_blob_numpy` of its rows and its codes: its rows as int32, then
    their packed codes), or None where it drew no row: every drawn row of the site made an array by one
    np.array, its codes gathered by one numpy take, and each record's blob its two slices joined into one
    array and cut by one `split` (a view each), not an index, a conversion, a concatenation and a
    from_numpy per record (the engine's take draws ~70 records a take)."""
    drawn = [i for i, r in enumerate(audits) if r]
    out: list = [None] * len(audits)
    if not drawn:
        return out
    all_codes = codes.contiguous().numpy()
    lens = [len(audits[i]) for i in drawn]
    local = np.array([row for i in drawn for row in audits[i]], dtype=np.int64)  # each record's rows, in order
    picked = all_codes[local + np.repeat(tokens[drawn], lens)]
    picked = picked.reshape(picked.shape[0], -1)  # [drawn rows, a row's code bytes]
    row_bytes = local.astype("<i4").view(np.uint8).reshape(-1, 4)  # [drawn rows, 4]
    pieces, sizes, at = [], [], 0
    for n in lens:
        pieces += [row_bytes[at : at + n].reshape(-1), picked[at : at + n].reshape(-1)]
        sizes.append(n * (4 + picked.shape[1]))
        at += n
    for i, blob in zip(drawn, torch.from_numpy(np.concatenate(pieces)).split(sizes)):
        out[i] = blob
    return out
