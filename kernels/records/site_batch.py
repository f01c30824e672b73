"""Every sparse (layer, site) of a micro-batch's records unpacked at once: what
`GuidanceRecord.site_of_all` gives for each (layer, site), from a few numba calls in place of one per site.

A trainer's step reads every guided site of all its samples (16 (layer, site)s x 4 records in the bench):
site by site that was 16 calls of `unpack_fields_many`, each ~100-140 us of planning, concatenating and
wrapping around a ~30 us numba loop. Here the payloads of all sites whose rows split alike (equal segments
per row S and blocks per segment bps: K / V of every layer, fc1 of every layer, fc2 of every layer) go
through one `unpack_many` call, and each site's fields are its slice of that call's output: the same
integers, since unpack_many writes each payload's rows in order into its own span of the output.

Only the case the native path batches (CPU payloads, TRACE_FP4_CPU_BACKEND=native, >= 2 records, every
record sparse at the layer, every payload's header accepted) is done here; anything else returns None and
the caller reads site by site, which also raises site_of_all's refusal naming the record, layer and site."""

from ..errors import SparseError
from ..guides.sparse import SparseGuide
from .layout import guide_type, site_rows, tensor_name


def sparse_sites_of_all(records: list, keys: list[tuple[int, str]]) -> dict[tuple[int, str], SparseGuide] | None:
    """{(layer, site): SparseGuide of all records' rows concatenated} for `keys`, equal to
    `GuidanceRecord.site_of_all(records, layer, site)` of each; None where this batch is not the native
    path's case (see the module's docstring) and the caller reads each site with site_of_all."""
    from .. import cpu_native
    from ..guides.sparse.wire import _plan, unpack_planned

    if len(records) < 2 or not keys or not cpu_native.enabled():
        return None
    groups: dict[tuple[int, int, int], list] = {}  # (S, nb, bps) -> [(key, inner, per-record (blob, plan)), ...]
    for layer, site in keys:
        if any(guide_type(r.modes[layer]) is not SparseGuide for r in records):
            return None
        if any(site not in r.shape.layer_sites(layer) for r in records):
            return None
        rows = [site_rows(r.shape, r.num_tokens, site) for r in records]
        if len({K for _, K in rows}) != 1:
            return None
        name = tensor_name(layer, site, "sparse")
        blobs = [r.tensors.get(name) for r in records]
        if not all(b is not None and b.device.type == "cpu" for b in blobs):
            return None
        try:
            plans = [_plan(b, lead, K) for b, (lead, K) in zip(blobs, rows)]
        except SparseError:
            return None  # site_of_all raises it, naming the record
        inner = tuple(rows[0][0][1:])
        if any(tuple(lead[1:]) != inner for lead, _ in rows):
            return None
        S, nb, bps = plans[0][1], plans[0][2], plans[0][3]
        groups.setdefault((S, nb, bps), []).append(((layer, site), inner, blobs, plans))

    out = {}
    for (S, nb, bps), sites in groups.items():
        csyn, ssyn, header = unpack_planned([b for _, _, bs, _ in sites for b in bs],
                                            [p for _, _, _, ps in sites for p in ps])
        r0 = 0
        for key, inner, _, ps in sites:
            R = sum(p[0] for p in ps)  # this site's rows, all records
            out[key] = SparseGuide(csyn[r0 * S:(r0 + R) * S].reshape(-1, *inner, S),
                                   ssyn[r0 * nb:(r0 + R) * nb].reshape(-1, *inner, nb),
                                   header[r0:r0 + R].reshape(-1, *inner))
            r0 += R
    return out
