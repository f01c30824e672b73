"""Fake-quantize one captured site's input rows: guided where a record row exists, RTN elsewhere.

All FP4 arithmetic is `trace_kernels.fake_quantize` (straight-through gradient). Rows without a guide
use round-to-nearest with the global amax `trace_kernels.site_amax` picks from the TraceConfig, as the
engines do: the trainer's own per-row (per-token) amax, or the config's static value; when a row is
split over tensor-parallel ranks the per-row amax is the max over the whole row (all-reduced), as the
engine sees it.
"""

from dataclasses import dataclass, field

import torch
from trace_kernels import Guide, NVFP4Tensor, codewords, count_saturated, fake_quantize, quantize, site_amax
from trace_kernels.fake_quant import straight_through
from trace_kernels.guides.full import codeword_mismatches

from . import audit_counts_host
from .whole_rows import whole_rows_straight_through


@dataclass
class SiteInput:
    """What a site needs to know about the rows of its input tensor (dimension 0)."""

    batch: object  # TraceBatch or None (plain RTN)
    layer: int
    site: str
    recompute: bool = False  # a recompute pass: same numerics, no counting, no capture
    guide: Guide | None = None  # guide rows for `guided_idx`, this rank's columns
    guided_idx: torch.Tensor | None = None  # int64 rows of x that have a guide, increasing
    fallback: dict = field(default_factory=dict)  # reason -> number of rows that fell back to RTN
    positions: torch.Tensor | None = None  # flat token position of every row (capture)
    slots: torch.Tensor | None = None  # routed slot of every row (moe_fc2_in capture)
    # (x, decoded rows, report, values, RTN NVFP4Tensor or None, x._version then): the sparse decode of x's
    # guided rows, made beforehand together with other experts' rows (expert_rows.LayerExpertRows.predecode);
    # used when this site quantizes that same x, unwritten since (the version counter says so)
    predecoded: tuple | None = None
    # the layer's comparisons of this site over all its experts (expert_rows.SiteCounts): this site hands
    # over its codes instead of comparing them itself
    site_counts: object | None = None


def rtn_amax(x: torch.Tensor, site: "SiteInput | None", config, group) -> torch.Tensor:
    """The round-to-nearest global amax of every row: `trace_kernels.site_amax`, the engines' decision
    (per token, or the config's static value)."""
    static = config is not None and config.activation_scale == "static"
    if static and site is None:
        raise RuntimeError("trace_megatron: a static activation amax needs the layer and site of every input")
    amax = site_amax(config, site.layer if site is not None else 0, site.site if site is not None else "", x.detach())
    if not static and group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def rtn_from_decode(config, group, block_scale: str) -> bool:
    """Whether a sparse decode can hand over the round-to-nearest codes a site needs (its `rtn_out`): the
    amax is each row's own (per token, rows whole on this rank) and the block scale is "6", which is the
    RTN the native decode computes in its pass over the rows (`quantize(x, row_amax(x))`'s bytes)."""
    static = config is not None and config.activation_scale == "static"
    whole = group is None or torch.distributed.get_world_size(group) == 1
    return not static and whole and block_scale == "6"


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are views of the same elements (same memory, shape, strides, dtype): the same values
    without reading them. A linear's input arrives as such a view of the tensor its experts' rows were
    decoded for (Megatron's identity region functions hand on a new tensor object over the same data),
    where torch.equal would read every element again."""
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def _merge(q: NVFP4Tensor, idx: torch.Tensor, qg: NVFP4Tensor, whole: bool) -> NVFP4Tensor:
    """q's rows with the guided rows `idx` replaced by qg's; `whole` (idx is every row): qg itself, which
    is what the copies give then (same shapes and dtypes checked), without them."""
    if whole and qg.global_amax.shape == q.global_amax.shape and qg.global_amax.dtype == q.global_amax.dtype:
        return qg
    amax = q.global_amax.clone()
    amax[idx] = qg.global_amax
    return NVFP4Tensor(q.codes.index_copy(0, idx, qg.codes), q.scales.index_copy(0, idx, qg.scales), amax)


def _count_audit(stats, batch, site: SiteInput, idx: torch.Tensor, q_rtn: NVFP4Tensor, q_guided: NVFP4Tensor) -> None:
    if site.positions is None:
        return
    count_audit(stats, batch, site.layer, site.site, site.positions[idx], None if site.slots is None else site.slots[idx],
                q_rtn.codes, q_guided.codes)


def count_audit(stats, batch, layer: int, site: str, positions: torch.Tensor, slots: torch.Tensor | None,
                rtn_codes: torch.Tensor, ours: torch.Tensor) -> None:
    """Compare the guided rows (at flat `positions`; `slots`: their routed slot, moe_fc2_in) whose tokens
    the record audits with the audit's full codes (and the trainer's own round-to-nearest `rtn_codes` with
    them: the flip density the rates must cover). One gather finds them (the batch maps each token
    position to its audit row); the counts compare packed codes, codeword by codeword (-0 folded into +0,
    as `codewords`)."""
    table = batch.audit_by_position(layer, site)
    if table is None:
        return
    by_pos, audit = table
    if audit_counts_host.host(by_pos, audit, positions, slots, rtn_codes, ours):  # the same counts, with numpy
        audit_counts_host.count_audit(stats, by_pos, audit, positions, slots, rtn_codes, ours)
        return
    a = by_pos[positions]
    sel = torch.nonzero(a >= 0).flatten()
    if not sel.numel():
        return
    theirs = audit[a[sel]]  # packed [n, ..., K // 2]
    if theirs.shape[1:] != ours.shape[1:] and slots is not None and theirs.shape[2:] == ours.shape[1:]:
        # moe_fc2_in: the audit holds every routed slot of the token; this row is its router slot (the
        # record's slot order, which routing replay keeps)
        theirs = theirs[torch.arange(sel.numel(), device=theirs.device), slots[sel]]
    if theirs.shape[1:] != ours.shape[1:]:  # a tensor-parallel shard of the row: not lined up here
        stats.audit_skipped_rows += int(sel.numel())
        return
    stats.audit_rows += int(sel.numel())
    stats.audit_values += theirs.numel() * 2
    stats.audit_mismatch += codeword_mismatches(ours[sel], theirs)
    stats.audit_mismatch_rtn += codeword_mismatches(rtn_codes[sel], theirs)


def fake_quantize_site(x: torch.Tensor, site: SiteInput | None, amax_group=None, config=None,
                       return_quantized: bool = False):
    """`amax_group`: the process group over which each row of `x` is split (row-parallel inputs), so
    the round-to-nearest amax is the whole row's; None when rows are whole on this rank. `config`: the
    layer's TraceConfig (its activation_scale decides the round-to-nearest amax). `return_quantized`:
    also return the NVFP4Tensor the output dequantizes (guided rows merged in), which the exact expert
    GEMM multiplies."""
    block_scale = config.block_scale if config is not None else "6"
    if site is None:
        amax = rtn_amax(x, site, config, amax_group)
        out, q = fake_quantize(x, global_amax=amax, return_quantized=True, block_scale=block_scale)
        return (out, q) if return_quantized else out
    idx = site.guided_idx
    guided = site.guide is not None and idx is not None and idx.numel() > 0
    batch = site.batch
    whole = guided and idx.numel() == x.shape[0]
    capturing = batch is not None and batch.capture
    # Every row guided by a sparse decode (the usual case): the output is the decode's values, the
    # round-to-nearest output would be thrown away, so only the RTN codes are made (for the counts and
    # the merge's shape check), or none at all when the layer rounded these rows already with every
    # expert's (SiteInput.predecoded's RTN part, one call per layer and site: the rounding is per row).
    rtn_codes_only = whole and site.guide.encoding == "sparse" and not capturing
    amax = None
    pre = site.predecoded
    # the decode made ahead is of these values (checked once; other values are a bug, refused below)
    pre_ok = pre is not None and (pre[0] is x or _same_memory(pre[0], x) or torch.equal(pre[0], x))
    if pre_ok and len(pre) > 5 and pre[0]._version != pre[5]:
        # the same memory, written in place after the decode (views share the version counter): the decode
        # is of values x no longer holds
        raise RuntimeError(f"trace_megatron: layer {site.layer} {site.site}: its input was written in place after its "
                           f"rows were decoded ahead (tensor version {pre[5]} -> {pre[0]._version}); quantize it "
                           "before writing to it, or write to a copy")
    early = None  # (decoded rows, report, values) of a decode made here before the rounding below
    if rtn_codes_only and pre is None and rtn_from_decode(config, amax_group, block_scale):
        # nothing decoded ahead (K / V): the decode's own pass hands over the RTN codes too (native path),
        # instead of a second pass over x
        rtn_out = []
        early = site.guide.rounding_target_values(x, block_scale=block_scale, rtn_out=rtn_out)
        pre_rtn = rtn_out[0] if rtn_out else None
    else:
        pre_rtn = pre[4] if pre_ok and len(pre) > 4 else None
    if rtn_codes_only:
        if pre_rtn is not None:
            q = pre_rtn
        else:
            amax = rtn_amax(x, site, config, amax_group)
            q = quantize(x.detach(), amax, block_scale=block_scale)
        out = None
    else:
        amax = rtn_amax(x, site, config, amax_group)
        out, q = fake_quantize(x, global_amax=amax, return_quantized=True, block_scale=block_scale)
    report = guide = q_g = None
    if guided:
        # every row guided by a sparse decode: x itself (whole_rows_straight_through gives index_select's
        # gradient bytes without the copies); else the guided rows
        whole_sparse = whole and site.guide.encoding == "sparse"
        x_g = x if whole_sparse else x.index_select(0, idx)
        if site.guide.whole_rows and amax_group is not None and torch.distributed.get_world_size(amax_group) > 1:
            raise NotImplementedError(
                f"trace_megatron: {site.guide.encoding} guidance needs whole rows on a rank (no row-split TP)"
            )
        # What the rounding follows: the guide itself, or (sparse) the rollout's rows worked out from the
        # syndromes and our own values, with a report of what that could not resolve.
        if site.guide.encoding == "sparse":
            # the decode is already x_g's guided rounding (its last step): rounding x_g toward it again
            # would give the same codes, so only its values are taken (the native path computes them in
            # the decode's own pass)
            if early is not None:  # (x_g is x: every row guided)
                guide, report, values = early
            elif pre is None:
                guide, report, values = site.guide.rounding_target_values(x_g, block_scale=block_scale)
            elif pre_ok:
                guide, report, values = pre[1:4]
            else:  # the decode (and its share of the counters) was of other values: a bug, never papered over
                raise RuntimeError(f"trace_megatron: layer {site.layer} {site.site} was decoded ahead for other "
                                   "input values than the ones it quantizes")
            q_g = guide
            out_g = whole_rows_straight_through(x, values) if whole_sparse else straight_through(x_g, values)
        else:
            guide, report = site.guide.rounding_target(x_g, block_scale=block_scale)
            out_g, q_g = fake_quantize(x_g, guide=guide, return_quantized=True, block_scale=block_scale)
        # Every row guided (idx increasing, so then 0..n-1): the guided output is the output. Its gradient is
        # the same too: x's rows get index_select's backward (0 + g, as before) and no longer a zero from
        # the unused round-to-nearest branch, which added nothing (a + 0 == a for a = 0 + g, never -0).
        out = out_g if whole else out.index_copy(0, idx, out_g)
    q_engine = None
    if capturing and batch.perturb is not None:
        # Emulate a second engine end to end (tests): it rounds its own, slightly different values and
        # computes on with those codes, so its later sites see the consequences of its codes.
        q_engine = batch.perturbed_quantize(x)
        # straight-through like fake_quantize; value exactly the dequantized codes (x - x is exactly 0,
        # while x + (xq - x) would round again in BF16)
        out = q_engine.dequantize(x.dtype, block_scale=block_scale) + (x - x.detach())
    need_q = return_quantized or (capturing and not site.recompute)
    q_used = (q_engine if q_engine is not None else (_merge(q, idx, q_g, whole) if guided else q)) if need_q else None
    if batch is None or site.recompute:
        return (out, q_used) if return_quantized else out
    if config is not None and config.activation_scale == "static":
        # values above the static amax saturate (as in the engines): counted, never silent; an expert's
        # site of a sparse layer counts its own too
        stats = batch.site_stats(site.layer, site.site)
        stats.saturated_values += int(count_saturated(x.detach(), amax if amax is not None else
                                                      rtn_amax(x, site, config, amax_group)))
    if site.site_counts is None:
        # (an expert's site of a sparse layer counts nothing more itself: the layer counts its rows,
        # fallbacks, decode report and comparisons for every expert at once, expert_rows.SiteCounts)
        _count_site(batch, site, guided, idx, whole, q, q_g, guide, report)
    if batch.capture:
        batch.capture_rows(site.layer, site.site, site.positions, q_used, site.slots, values=x)
    return (out, q_used) if return_quantized else out


def _count_site(batch, site: SiteInput, guided: bool, idx, whole: bool, q, q_g, guide, report) -> None:
    """A site's fallbacks, guided rows, mismatches, decode report and audit, into its counters."""
    stats = batch.site_stats(site.layer, site.site)
    for reason, rows in site.fallback.items():
        setattr(stats, f"fallback_{reason}", getattr(stats, f"fallback_{reason}") + int(rows))
    if guided:
        stats.guided_rows += idx.numel()
        stats.guided_elements += q_g.codes.numel() * 2
        q_rtn_g = q if whole else q[idx]
        stats.mismatch_rtn += guide.mismatches(q_rtn_g)
        # a sparse decode is q_g itself: 0 by construction, not worth comparing
        stats.mismatch_guided += 0 if q_g is guide else guide.mismatches(q_g)
        if report is not None:
            add_report(stats, report)
            _count_audit(stats, batch, site, idx, q_rtn_g, q_g)


def add_report(stats, report) -> None:
    """A sparse decode's report into a site's counters."""
    stats.sparse_segments += report.segments
    stats.sparse_unresolved_code_segments += report.unresolved_code_segments
    stats.sparse_unresolved_scale_segments += report.unresolved_scale_segments
    stats.sparse_code_flips += report.code_flips
    stats.sparse_amax_list_rows += report.amax_list_rows
