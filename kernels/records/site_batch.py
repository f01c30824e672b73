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

import torch

from ..errors import SparseError
from ..guides.sparse import SparseGuide
from ..guides.sparse.wire import _HEADER, _plan, _plan_of, unpack_planned
from .layout import guide_type, site_rows, tensor_name


def sparse_sites_of_all(records: list, keys: list[tuple[int, str]]) -> dict[tuple[int, str], SparseGuide] | None:
    """{(layer, site): SparseGuide of all records' rows concatenated} for `keys`, equal to
    `GuidanceRecord.site_of_all(records, layer, site)` of each; None where this batch is not the native
    path's case (see the module's docstring) and the caller reads each site with site_of_all."""
    from .. import cpu_native

    if len(records) < 2 or not keys or not cpu_native.enabled():
        return None
    # What depends on the layer or on (shape, T, site) only is found once, not per record and site (64
    # (record, site)s a step in the bench: each Python step here is paid 64 times).
    sparse_layers: dict[int, bool] = {}
    sites_of: dict[tuple, tuple] = {}  # (id(shape), layer) -> layer_sites (the records keep their shapes alive)
    rows_of: dict[tuple, tuple] = {}  # (id(shape), T, site) -> site_rows
    groups: dict[tuple[int, int, int], list] = {}  # (S, nb, bps) -> [(key, inner, per-record (blob, plan)), ...]
    for layer, site in keys:
        ok = sparse_layers.get(layer)
        if ok is None:
            ok = sparse_layers[layer] = all(guide_type(r.modes[layer]) is SparseGuide for r in records)
        if not ok:
            return None
        name = tensor_name(layer, site, "sparse")
        rows, blobs = [], []
        for r in records:
            sk = (id(r.shape), layer)
            sites = sites_of.get(sk)
            if sites is None:
                sites = sites_of[sk] = r.shape.layer_sites(layer)
            if site not in sites:
                return None
            rk = (id(r.shape), r.num_tokens, site)
            lead_K = rows_of.get(rk)
            if lead_K is None:
                lead_K = rows_of[rk] = site_rows(r.shape, r.num_tokens, site)
            b = r.tensors.get(name)
            if b is None or b.device.type != "cpu":
                return None
            rows.append(lead_K)
            blobs.append(b)
        K = rows[0][1]
        for _, k in rows:
            if k != K:
                return None
        try:
            plans = [_plan_host(b, lead, k) for b, (lead, k) in zip(blobs, rows)]
        except SparseError:
            return None  # site_of_all raises it, naming the record
        inner = tuple(rows[0][0][1:])
        for lead, _ in rows:
            if tuple(lead[1:]) != inner:
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


def _plan_host(blob, lead: tuple, K: int):
    """wire._plan of a host payload (checked on the host above): its header bytes read through numpy and
    planned by wire._plan_of, as _plan does, without _plan's per-call steps for any tensor (64 payloads a
    step in the bench); anything _plan would refuse goes through _plan, which raises."""
    if blob.dtype == torch.uint8 and blob.dim() == 1:
        n = blob.numel()
        if n >= _HEADER:
            return _plan_of(tuple(blob.numpy()[:_HEADER].tolist()), n, lead, K)
    return _plan(blob, lead, K)
