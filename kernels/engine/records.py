"""One request's captured rows -> its GuidanceRecord, the same way in every engine.

An engine hands over the request's rows as chunks in token order (one per forward step in vLLM, one
gathered from the KV slots in SGLang), each a pair of {layer: routed expert ids [n, top_k]} and
{(layer, site): NVFP4Tensor rows}, plus the weights identity taken when the rows were captured and the
request's token identity (token ids or their digest, number of prompt tokens).
"""

from ..records import GuidanceRecord, RecordBuilder


def assemble_record(shape, config, chunks, *, weights: tuple = (None, None), identity: dict | None = None) -> GuidanceRecord:
    """`chunks`: iterable of (routing, sites) in token order; `weights`: (version, digest);
    `identity`: RecordBuilder.set_identity keywords (token_ids or token_digest, num_prompt_tokens)."""
    version, digest = weights
    builder = RecordBuilder(shape, config, weights_version=version, weights_digest=digest)
    if identity:
        builder.set_identity(**identity)
    for routing, sites in chunks:
        for layer in sorted(routing):
            builder.add_routing(layer, routing[layer])
        for (layer, site), q in sorted(sites.items()):
            builder.add(layer, site, q)
    return builder.build()
