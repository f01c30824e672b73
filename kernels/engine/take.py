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

import itertools
import math
from typing import NamedTuple

import numpy as np
import torch

from .. import cpu_native, envs
from ..guides.sparse.rates import layer_rates, segment
from ..guides.sparse.wire import version_for
from ..records import GuidanceRecord, RecordBuilder
from ..records.layout import packs_routing, routing_name, tensor_name
from ..records.routing import id_bits
from ..tensor import NVFP4Tensor
from .captured_rows import StepChunks
from .host_arena import arena_rows, gather_rows
from .step_buffers import ROUTING
from .step_gather import gather_step_chunks


class SiteRows(NamedTuple):
    """Where the batch's site rows lie: `arrays` one {(layer, site): (codes, scales, float32 amax) numpy
    arrays} per chunk (rows of [*row[:-1], K/2], [*row[:-1], K/16], [*row[:-1]]), token t of all records
    back to back row row_index[t] of chunk row_chunk[t] (the host arena's chunks, read in place; or one
    gathered tensor per key, its rows in order)."""

    arrays: list
    row_chunk: np.ndarray
    row_index: np.ndarray


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
    packing = [layer for layer in moe if packs_routing(modes[layer])]
    batch = _gathered(shape, moe, keys, requests, joiner, packing) or _joined(shape, moe, keys, requests, joiner)
    if batch is None:
        return _counted(out)
    chosen, tokens, routing, sites, prepacked = batch
    idents = [_identity(shape, config, requests[i], int(tokens[j + 1] - tokens[j])) for j, i in enumerate(chosen)]
    # prepacked None: the arena's packing kernel met an id outside [0, num_experts) (the per-record build names it)
    if prepacked is None or not (_routing_in_range(shape, routing) and _rates_fit(shape, config, guided)):
        return _counted(out)
    tensors = [{} for _ in chosen]
    # each record's {name: (tensor, its bytes)} of the tensors cut from the take's kernel outputs (_pieces),
    # handed to the writer with the record (GuidanceRecord.host_bytes); a tensor made otherwise has none
    raws = [{} for _ in chosen]
    audits = _audit_rows(config, guided, idents, tokens)
    encoded = _encode_sites(shape, config, guided, sites, idents, tokens, audits)
    # each record's tensors in the order the per-record build adds them: per layer its routing, then its sites
    at = 0
    for layer in range(shape.num_layers):
        if layer in moe:
            packed = packs_routing(modes[layer])
            name = routing_name(layer, packed)
            if layer in prepacked:  # packed from the arena in place (_arena_routing): (tensor, bytes) pairs
                for t, r, pair in zip(tensors, raws, prepacked[layer]):
                    t[name] = pair[0]
                    r[name] = pair
            else:
                ids = routing[layer]
                each = _pack_routing(ids, tokens, shape.num_experts) if packed else _int16(ids, tokens)
                for t, v in zip(tensors, each):
                    t[name] = v
        if modes[layer] is None:
            continue
        for site in shape.layer_sites(layer):
            _put_site(config, layer, site, encoded[at], idents, tensors, raws)
            at += 1
    config_text = (config, config.to_json())  # one metadata text for every record of the take
    for i, ident, t, r in zip(chosen, idents, tensors, raws):
        if ident is not None:
            out[i] = GuidanceRecord(shape, config, ident.num_tokens, modes, t, ident)
            out[i].config_text = config_text
            if len(r) == len(t):  # every tensor cut from the take's outputs: the writer reads their bytes as is
                out[i].host_bytes = r
    return _counted(out)


_NO_BYTES = memoryview(b"")  # the bytes of the empty uint8 tensors the take shares (_put_site)


def _pieces(out: np.ndarray, sizes: np.ndarray) -> list:
    """`out` (a kernel's uint8 output, its pieces back to back) cut by `sizes`: per piece (a uint8 tensor view,
    a memoryview of its bytes) where it has bytes, else None; one torch split into the non-empty pieces (not
    a view per empty one). The memoryview is what take_bytes joins into the record's body (GuidanceRecord.
    host_bytes): a `.numpy()` of each tensor view cost ~2 us there, ~0.8 ms a take."""
    if out.dtype != np.uint8 or out.ndim != 1:  # GuidanceRecord.host_bytes holds 1-D uint8 tensors only
        raise TypeError(f"trace_fp4: a take output of {out.dtype} [{out.shape}], expected 1-D uint8")
    full = sizes > 0
    kept = sizes[full].tolist()
    views = torch.from_numpy(out).split(kept)
    raw = memoryview(out)
    pairs, a = [], 0
    for v, n in zip(views, kept):
        pairs.append((v, raw[a : a + n]))
        a += n
    pairs = iter(pairs)
    return [next(pairs) if f else None for f in full.tolist()]


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


def _gathered(shape, moe, keys, requests, joiner, packing):
    """(every request's index, token offsets, {layer: ids}, SiteRows, {layer: each record's packed ids})
    with each key's rows of all requests back to back: on the native engine's host arena where they lie
    (`arena_rows`: the site rows read in place by the encoder, the `packing` layers' ids packed in place by
    take_routing, the other layers' ids gathered), else from the joiner's one gather per key
    (`ChunkJoiner.gather`: the requests of a take that ran in the same steps); None when it does not apply
    or a key's rows do not fit (then each request is joined on its own: `_joined`)."""
    if all(isinstance(c, StepChunks) for c, _, _ in requests):  # the capture store's steps, by their layout
        per = [c.rows() for c, _, _ in requests]  # each request's token rows
        tokens = np.cumsum([0] + per)
        rows = arena_rows([c for c, _, _ in requests])
        if rows is not None:
            if not tokens[-1] or 0 in per:
                return None
            found = _arena_sites(shape, moe, keys, rows, tokens, packing)
            return None if found is None else (list(range(len(requests))), tokens, *found)
        routing = joiner.gather_layouts([(c.routing, c.ranges) for c, _, _ in requests])
        sites = joiner.gather_layouts([(c.sites, c.ranges) for c, _, _ in requests]) if routing is not None else None
        if sites is None:  # requests that ran in different steps (ended at different lengths): one gather still
            routing, sites = gather_step_chunks([c for c, _, _ in requests]) or (None, None)
    else:
        routing = joiner.gather([[r for r, _ in c] for c, _, _ in requests])
        sites = joiner.gather([[s for _, s in c] for c, _, _ in requests]) if routing is not None else None
        per = [sum((m.stop - m.start) for m, _ in c) for c, _, _ in requests] if sites is not None else None
    if sites is None:
        return None
    tokens = np.cumsum([0] + per)
    if not tokens[-1] or 0 in per or not _fits(shape, moe, keys, routing, sites, int(tokens[-1])):
        return None
    return list(range(len(requests))), tokens, routing, _in_order(sites, int(tokens[-1])), {}


def _arena_sites(shape, moe, keys, rows, tokens: np.ndarray, packing: list):
    """({layer: ids}, SiteRows, {layer: each record's packed ids}) of the host arena's rows (`arena_rows`'
    answer, tokens[-1] tokens): the `packing` layers' ids packed where they lie (`_arena_routing`; the third
    item None where an id is out of range), the other layers' ids gathered (one index a layer), the site
    rows left in their chunks; None where a key's arrays do not fit a batched build (`_fits`' conditions,
    on the chunks' arrays: the kernels read them by address, so every token's row must lie inside them)."""
    T = int(tokens[-1])
    found, chunks, row_chunk, row_index = rows
    if len(found) != len(moe) + len(keys) or any(k not in found for k in keys):
        return None
    ends = np.zeros(len(chunks), dtype=np.int64)  # each chunk's rows read: [0, ends[c])
    np.maximum.at(ends, row_chunk, row_index + 1)
    route_keys = [k for k in found if k[0] == ROUTING]
    in_place = all((ROUTING, layer) in found for layer in moe) and all(
        _routing_arrays_fit(shape.top_k, ch.arrays.get((ROUTING, layer)), int(ends[c]))
        for layer in packing for c, ch in enumerate(chunks))
    if not in_place:  # not as the kernel reads them: every layer's ids gathered and checked as before
        packing = []
    gathered = [k for k in route_keys if k[1] not in packing]
    routing = {k[1]: v[0] for k, v in gather_rows(rows, gathered).items()} if gathered else {}
    rest = [layer for layer in moe if layer not in packing]  # the layers whose ids were gathered
    if not moe or (rest and not _fits(shape, rest, [], routing, {}, T)):
        return None
    for c, ch in enumerate(chunks):
        for layer, site in keys:
            row = shape.row_shape(site)
            arrs = ch.arrays.get((layer, site))
            if not (isinstance(arrs, tuple) and len(arrs) == 3 and _site_arrays_fit(row, arrs, int(ends[c]))):
                return None
    return routing, SiteRows([ch.arrays for ch in chunks], row_chunk, row_index), _arena_routing(
        shape, packing, chunks, row_chunk, row_index, tokens)


def _routing_arrays_fit(top_k: int, ids, n: int) -> bool:
    """Whether a chunk's routing ids (a 1-tuple of a numpy array, as the arena keeps them) hold at least n
    rows of top_k int16 ids as take_routing reads them, C-contiguous."""
    if not (isinstance(ids, tuple) and len(ids) == 1 and isinstance(ids[0], np.ndarray)):
        return False
    a = ids[0]
    return a.dtype == np.int16 and a.ndim == 2 and a.shape[1] == top_k and a.shape[0] >= n and a.flags.c_contiguous


def _arena_routing(shape, packing: list, chunks: list, row_chunk, row_index, tokens: np.ndarray):
    """{layer: each record's packed ids, (tensor, its bytes) as `_pieces` cuts them} of the `packing` layers
    (records.routing.pack_routing's bytes), every layer and record in one take_routing call, its output cut
    by one split; None where an id lies outside [0, num_experts) (_routing_in_range's refusal)."""
    if not packing:
        return {}
    from ..cpu_native import take_routing

    arrays = [[ch.arrays[(ROUTING, layer)][0] for ch in chunks] for layer in packing]
    out, sizes, bad = take_routing.pack_take(arrays, row_chunk, row_index, tokens, shape.top_k, shape.num_experts,
                                             id_bits(shape.num_experts))
    if bad:
        return None
    n = len(tokens) - 1
    pairs = _pieces(out, sizes)  # every record's ids take bytes (tokens > 0): no None
    return {layer: pairs[k * n : (k + 1) * n] for k, layer in enumerate(packing)}


def _site_arrays_fit(row: tuple, arrs: tuple, n: int) -> bool:
    """Whether (codes, scales, amax) numpy arrays hold at least n rows of `row` values as the encoder reads
    them (uint8 codes [*row[:-1], K/2], uint8 scales [*row[:-1], K/16], float32 amax [*row[:-1]]),
    C-contiguous."""
    codes, scales, amax = arrs
    lead = tuple(row[:-1])
    return (codes.shape[1:] == (*lead, row[-1] // 2) and scales.shape[1:] == (*lead, row[-1] // 16)
            and amax.shape[1:] == lead and codes.dtype == np.uint8 and scales.dtype == np.uint8
            and amax.dtype == np.float32 and min(codes.shape[0], scales.shape[0], amax.shape[0]) >= n
            and codes.flags.c_contiguous and scales.flags.c_contiguous and amax.flags.c_contiguous)


def _in_order(sites: dict, T: int) -> SiteRows:
    """SiteRows of rows already back to back (one tensor per key, `_fits` checked): one chunk, in order."""
    from ..cpu_native import as_numpy

    arrays = {k: (as_numpy(q.codes), as_numpy(q.scales), as_numpy(q.global_amax)) for k, q in sites.items()}
    return SiteRows([arrays], np.zeros(T, dtype=np.int64), np.arange(T, dtype=np.int64))


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
    tokens = np.cumsum([0] + per)
    return chosen, tokens, routing, _in_order(sites, int(tokens[-1])), {}


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


def _audit_rows(config, guided: list, idents: list, tokens: np.ndarray) -> tuple:
    """(starts int64 [sites * n + 1], rows int64): record i of guided site k audits its token rows
    rows[starts[k * n + i] : starts[k * n + i + 1]] (none where its identity does not fit, or with no audit
    fraction): every draw of the take at once (cpu_native.audit_draw: the seeds' generators run side by
    side), the same rows as sparse_parts.encode_site's `audit_rows` per record and site."""
    n = len(idents)
    if config.sparse_audit <= 0:
        return np.zeros(len(guided) * n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    from ..cpu_native import audit_draw

    live = [(i, ident.token_digest) for i, ident in enumerate(idents) if ident is not None]
    lens = np.diff(tokens).tolist()  # each record's token rows, as ints (not a numpy scalar per draw)
    draws = [(lens[i], layer, site, digest) for layer, site in guided for i, digest in live]
    rows = audit_draw.row_lists(draws, config.sparse_audit)
    # the draws are by site, then by record: each site's are one row of `counts`
    counts = np.zeros((len(guided), n), dtype=np.int64)
    if live and guided:
        counts[:, [i for i, _ in live]] = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)).reshape(len(guided), -1)
    starts = np.zeros(len(guided) * n + 1, dtype=np.int64)
    np.cumsum(counts.reshape(-1), out=starts[1:])
    return starts, np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(starts[-1]))


_PLAN: list = [None]  # (shape, config, guided, (meta, cols)) of the last take: the engine's are all alike


def _site_plan(shape, config, guided: list) -> tuple:
    """(meta int64 [sites, take_encode.META], cols int64): each guided site's shape, rates and parity
    columns for take_encode, made once for the (shape, config) of the takes (not 16 rate look-ups and
    column fetches a take)."""
    held = _PLAN[0]
    if held is not None and held[0] is shape and held[1] is config and held[2] == guided:
        return held[3]
    from ..cpu_native import sparse_encode, take_encode as te

    meta = np.zeros((len(guided), te.META), dtype=np.int64)
    cols, at = [], 0
    for k, (layer, site) in enumerate(guided):
        row = shape.row_shape(site)
        K, seg = row[-1], segment(row[-1])
        rates = layer_rates(config, layer, site, K)
        bps = seg // 16
        scol = sparse_encode._columns(rates.scale_bits, bps, 1) if 0 < rates.scale_bits < bps else sparse_encode._columns(0, 0, 1)
        ccol = sparse_encode._columns(rates.code_bits, seg, 2)
        meta[k, [te.INNER, te.K_, te.SEG, te.AMAX_BITS, te.SCALE_BITS, te.CODE_BITS, te.CHECK, te.CHOICE, te.VERSION]] = (
            math.prod(row[:-1]), K, seg, rates.amax_bits, rates.scale_bits, rates.code_bits, bool(rates.check),
            bool(rates.choice), version_for(rates))
        meta[k, [te.SCOL, te.NSCOL, te.CCOL, te.NCCOL]] = at, len(scol), at + len(scol), len(ccol)
        cols += [scol, ccol]
        at += len(scol) + len(ccol)
    plan = meta, np.concatenate(cols).astype(np.int64) if cols else np.zeros(0, dtype=np.int64)
    _PLAN[0] = (shape, config, list(guided), plan)
    return plan


def _encode_sites(shape, config, guided: list, sites: SiteRows, idents: list, tokens: np.ndarray, audits) -> list:
    """Per guided site, each record's (payload, audit blob or None) as (tensor, its bytes) pairs (`_pieces`):
    every site's payloads and the drawn rows' audit blobs in one take_encode call (`audits`: `_audit_rows`),
    the bytes of sparse_parts.encode_site per record and site; the one output cut by one `split` into views."""
    from ..cpu_native import take_encode

    n = len(idents)
    meta, cols = _site_plan(shape, config, guided)
    out, sizes = take_encode.encode_take(sites.arrays, guided, sites.row_chunk, sites.row_index,
                                         np.asarray(tokens, dtype=np.int64), meta, cols, *audits)
    # one split into the non-empty pieces (every payload, the few drawn audit blobs; most records of a site
    # draw no row at the default fraction), not a view per empty blob; each (tensor, its bytes)
    pieces = _pieces(out, sizes)
    return [(pieces[k * 2 * n : k * 2 * n + n], pieces[k * 2 * n + n : (k + 1) * 2 * n]) for k in range(len(guided))]


def _put_site(config, layer: int, site: str, encoded: tuple, idents: list, tensors: list, raws: list) -> None:
    """Every batched record's tensors of one sparse site: its payload and (with an audit fraction) its
    audit blob, an empty uint8 tensor where it drew no row (one shared by the site's records: a torch.empty
    each cost ~1 us); a record whose identity does not fit gets none (it is built alone). `raws`: each
    record's {name: (tensor, its bytes)}, given the same tensors."""
    payloads, blobs = encoded
    # the site's tensor names, the same in every record (made once, not per record)
    payload_name, audit_name = tensor_name(layer, site, "sparse"), tensor_name(layer, site, "audit")
    for t, r, ident, p in zip(tensors, raws, idents, payloads):
        if ident is not None:
            t[payload_name] = p[0]
            r[payload_name] = p
    if config.sparse_audit <= 0:
        return
    empty = torch.empty(0, dtype=torch.uint8)
    none = (empty, _NO_BYTES)
    for t, r, ident, blob in zip(tensors, raws, idents, blobs):
        if ident is not None:
            if blob is None:
                blob = none
            t[audit_name] = blob[0]
            r[audit_name] = blob
