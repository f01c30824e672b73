"""One request's captured rows -> its GuidanceRecord, the same way in every engine.

An engine hands over the request's rows as chunks in token order (one per forward step in vLLM, one
gathered from the KV slots in SGLang), each a pair of {layer: routed expert ids [n, top_k]} and
{(layer, site): NVFP4Tensor rows}, plus the weights identity taken when the rows were captured and the
request's token identity (token ids or their digest, number of prompt tokens).
"""

from ..records import GuidanceRecord, RecordBuilder
from .captured_rows import ChunkJoiner


def assemble_record(shape, config, chunks, *, weights: tuple = (None, None), identity: dict | None = None,
                    joiner: ChunkJoiner | None = None) -> GuidanceRecord:
    """`chunks`: iterable of (routing, sites) in token order; `weights`: (version, digest);
    `identity`: RecordBuilder.set_identity keywords (token_ids or token_digest, num_prompt_tokens);
    `joiner`: a ChunkJoiner shared by the requests taken together (they share their steps' joins).

    The chunks of each layer and site are joined first (ChunkJoiner: one concatenation and one index per
    key) and added once: a decode step is one row, so a request's record is hundreds of chunks
    per site, and the builder's per-`add` checks and its concatenation would otherwise run once per
    chunk and site. The record is byte for byte the same: the same rows in the same order. Chunks
    that do not join (shapes that differ) are added one by one, so the builder names what is wrong."""
    version, digest = weights
    builder = RecordBuilder(shape, config, weights_version=version, weights_digest=digest)
    if identity:
        builder.set_identity(**identity)
    chunks = list(chunks)
    joiner = joiner or ChunkJoiner()
    routing = joiner.join(r for r, _ in chunks)
    sites = joiner.join(s for _, s in chunks)
    for layer in sorted(routing):
        for ids in routing[layer] if isinstance(routing[layer], list) else [routing[layer]]:
            builder.add_routing(layer, ids)
    for (layer, site) in sorted(sites):
        q = sites[(layer, site)]
        for part in q if isinstance(q, list) else [q]:
            builder.add(layer, site, part)
    return builder.build()
