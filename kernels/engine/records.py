"""One request's captured rows -> its GuidanceRecord, the same way in every engine.

An engine hands over the request's rows as chunks in token order (one per forward step in vLLM, one
gathered from the KV slots in SGLang), each a pair of {layer: routed expert ids [n, top_k]} and
{(layer, site): NVFP4Tensor rows}, plus the weights identity taken when the rows were captured and the
request's token identity (token ids or their digest, number of prompt tokens).
"""

import torch

from ..records import GuidanceRecord, RecordBuilder
from ..tensor import NVFP4Tensor


def _joined_ids(parts: list) -> list:
    """The routing ids of one layer as one tensor (one `add_routing`), or the parts as they are where
    they do not join (the builder then names what is wrong with each)."""
    if len(parts) == 1:
        return parts
    try:
        return [torch.cat(parts)]
    except RuntimeError:
        return parts


def _joined_rows(parts: list) -> list:
    """The rows of one site as one NVFP4Tensor (codes, scales, one float32 amax per row), or the parts
    as they are where they do not join (the builder then names what is wrong with each)."""
    if len(parts) == 1:
        return parts
    codes = [p.codes for p in parts]
    try:
        c, s = torch.cat(codes), torch.cat([p.scales for p in parts])
    except RuntimeError:
        return parts
    if c.dim() < 2 or not c.shape[-1] or s.shape[:-1] != c.shape[:-1]:
        return parts
    # What an engine hands over: one float32 amax per row already, joined as they are
    amax = [p.global_amax for p in parts]
    try:
        a = torch.cat(amax)
    except RuntimeError:
        a = None
    if (a is not None and a.dtype == torch.float32 and a.shape == c.shape[:-1]
            and [x.shape[0] for x in amax] == [x.shape[0] for x in codes]):
        return [NVFP4Tensor(c, s, a)]
    width, amax = c.shape[-1], []
    for p, cp in zip(parts, codes):  # a per-tensor amax stands for every row of its part, as in `add`
        a, n = p.global_amax, cp.numel() // width
        if a.numel() == n:
            amax.append(a.reshape(n))
        elif a.numel() == 1:
            amax.append(a.reshape(1).expand(n))
        else:
            return parts
    return [NVFP4Tensor(c, s, torch.cat(amax).to(torch.float32).reshape(c.shape[:-1]))]


def assemble_record(shape, config, chunks, *, weights: tuple = (None, None), identity: dict | None = None) -> GuidanceRecord:
    """`chunks`: iterable of (routing, sites) in token order; `weights`: (version, digest);
    `identity`: RecordBuilder.set_identity keywords (token_ids or token_digest, num_prompt_tokens).

    The chunks of each layer and site are joined first and added once: a decode step is one row, so a
    request's record is hundreds of chunks per site, and the builder's per-`add` checks and the
    concatenation at build would otherwise run once per chunk and site (what the record is, byte for
    byte, does not change: the builder concatenates the same rows in the same order)."""
    version, digest = weights
    builder = RecordBuilder(shape, config, weights_version=version, weights_digest=digest)
    if identity:
        builder.set_identity(**identity)
    routing: dict[int, list] = {}
    sites: dict[tuple, list] = {}
    for r, s in chunks:
        for layer, ids in r.items():
            routing.setdefault(layer, []).append(ids)
        for key, q in s.items():
            sites.setdefault(key, []).append(q)
    for layer in sorted(routing):
        for ids in _joined_ids(routing[layer]):
            builder.add_routing(layer, ids)
    for (layer, site) in sorted(sites):
        for q in _joined_rows(sites[(layer, site)]):
            builder.add(layer, site, q)
    return builder.build()
