"""align's rate calibration: rates that follow the measured data, pass by pass, until the residual is
below its target.

align holds every record in full, so each trace_sparse recompute measures the true residual of every
layer and site (a 100% audit) and the flip density the trainer's own rounding leaves there (its RTN
mismatches at the same activations). The rate controller (kernels/guides/sparse/controller.py) turns
those counts into rates as it would a trainer's audit, with a target relative to each site's flip density
(the goal is a share of the mismatches RTN would leave), a raise of log2(residual / target) bits and the
density's code rate as a floor; a check-only site's residual (moe_fc2_in) is charged to the fc1 codes that
feed it. The recompute then runs again with the new rates, and again, until the whole model's residual is
at most `STOP_SHARE` of its RTN mismatches, or nothing moves, or the next pass is predicted to gain nothing
(`futile_changes`), or `MAX_PASSES` passes ran. Only raises: one
align run is too few values to bound a residual low enough to lower a rate (the controller's lowering
needs ~10x more audited values than a site holds here; the RL loop lowers over many steps).

When a further pass cannot help. More code bits fix one kind of residual only: a segment the decode
explained with a wrong pattern of the right syndrome (each bit halves the wrong patterns that share one).
They do not fix a segment no pattern within the wide search explains (unresolved: the trainer keeps its
own rounding there); they widen the search only up to its widest step (search.WIDE_STEPS[-1], 8 flips
among 24 candidates, reached at 21 code bits per 64 values and 16 per 32). So a raise of the code bits
alone, at a site whose rate already gets the widest search and whose last pass left unresolved code
segments, is predicted to change nothing. Measured on the held-out Qwen2-MoE (docs/measurements.md):
fc1 24 -> 27 / 28 bits left the residual exactly as it was, and so did a (9, 26) search step, at 2-3x the
decode time of a default-rate pass. A pass whose every change is such a raise is not run; a pass with
any other change (an amax or scale raise, a site below the widest search, a site with no unresolved
segment) runs. The JSON says per pass what it decided next and why, and lists the changes a stop skipped.
"""

import time

from trace_kernels.guides.sparse.rates import layer_rates, segment
from trace_kernels.guides.sparse.search import WIDE_STEPS, wide_search_for

from trace_kernels.guides.sparse.controller import RateController

from .recompute import SiteCounts

# the controller's own target: a site may keep 0.5% of its RTN flips (half of what the 99% goal allows,
# since 8 prompts' residual is a few token rows), never more than 0.1% of its values
RELATIVE_TARGET = RateController.relative_target
# stop once the model's residual is at most this share of its RTN mismatches (>= 99.5% removed)
STOP_SHARE = 0.005
MAX_PASSES = 3


def measured_counts(outcome) -> dict[str, float]:
    """The controller's flat counts from a recompute against the full records: every row audited."""
    measured = {}
    for (layer, site), c in outcome.sites.items():
        p = f"trace/layer{layer}/{site}"
        measured[f"{p}/audit_values"] = float(c.elements)
        measured[f"{p}/audit_mismatch"] = float(c.mismatched)
        measured[f"{p}/audit_mismatch_rtn"] = float(c.rtn_mismatched)
        measured[f"{p}/amax_mismatch_rows"] = float(c.amax_mismatched_rows)
        measured[f"{p}/amax_row_mismatch"] = float(c.amax_row_mismatched)
        for name, value in outcome.sparse_by_site.get(f"layer{layer}/{site}", {}).items():
            if name.startswith("sparse_"):
                measured[f"{p}/{name}"] = value
    return measured


def totals(outcome) -> tuple[int, int]:
    """(mismatched values, RTN mismatched values) over every site."""
    t = SiteCounts()
    for c in outcome.sites.values():
        t.add(c)
    return t.mismatched, t.rtn_mismatched


def below_target(outcome, stop_share: float = STOP_SHARE) -> bool:
    mismatched, rtn = totals(outcome)
    return mismatched <= stop_share * rtn


def unresolved_code_segments(outcome, layer: int, site: str) -> int:
    """Segments of `site` at `layer` the decode left unresolved in `outcome` (no pattern within the wide
    search explains their code syndrome)."""
    return int(outcome.sparse_by_site.get(f"layer{layer}/{site}", {}).get("sparse_unresolved_code_segments", 0))


def futile_changes(changes: list[dict], config, outcome, shape) -> list[str]:
    """The sites of `changes` (from the controller, against `config`) whose change is predicted to gain
    nothing: code bits raised alone (amax and scale bits as they were), at a site whose rate already gets the
    widest wide search and whose decode in `outcome` left unresolved code segments (see the module doc)."""
    futile = []
    for ch in changes:
        layer, site = ch["site"].split(".", 1)
        layer = int(layer)
        if ch["to"][:2] != ch["from"][:2]:
            continue
        K = shape.row_shape(site)[-1]
        code = layer_rates(config, layer, site, K).code_bits
        if wide_search_for(code, segment(K)) == WIDE_STEPS[-1] and unresolved_code_segments(outcome, layer, site) > 0:
            futile.append(ch["site"])
    return futile


def _site_unresolved(outcome, changes) -> dict[str, int]:
    out = {}
    for ch in changes:
        layer, site = ch["site"].split(".", 1)
        out[ch["site"]] = unresolved_code_segments(outcome, int(layer), site)
    return out


def calibrate(base, outcome, shape, recompute, *, max_passes: int = MAX_PASSES, stop_share: float = STOP_SHARE,
              relative_target: float = RELATIVE_TARGET):
    """Passes of (measure, controller, recompute) from `outcome` (the recompute under `base`).
    `recompute(config)` runs trace_sparse with the records encoded under `config` and returns its outcome.
    Returns (the config of the lowest residual, its outcome, passes: one dict per recompute run, with
    the changes it made, its residual, its wall time, whether it was kept (a pass whose residual is no
    lower than the best so far ends the calibration and is not kept) and `next`: what the calibration
    decided after it; stopped: why the calibration ended, one line; skipped: the changes a predicted-futile
    pass would have made, with their sites' unresolved code segments, or None)."""
    config, passes = base, []
    best = (totals(outcome)[0], config, outcome)
    stopped, skipped = f"{max_passes} passes ran", None
    while True:
        if below_target(outcome, stop_share):
            stopped = f"below target (residual at most {stop_share:.1%} of the RTN mismatches)"
            break
        if len(passes) == max_passes:
            break
        ctl = RateController(relative_target=relative_target)
        ctl.observe(measured_counts(outcome))
        new, changes = ctl.update(config, shape)
        if not changes:
            stopped = "no site gave evidence to move"
            break
        futile = futile_changes(changes, config, outcome, shape)
        if passes:
            passes[-1]["next"] = (f"continue: {len(changes) - len(futile)} of {len(changes)} changes may gain "
                                  "(an amax or scale raise, a site below the widest search or with no unresolved segment)")
        if len(futile) == len(changes):
            stopped = (f"predicted no gain: each of the {len(changes)} changes raises only the code bits of a site "
                       f"already at the widest search ({WIDE_STEPS[-1][0]} flips / {WIDE_STEPS[-1][1]} candidates) "
                       "whose last pass left unresolved code segments, which more code bits do not resolve")
            skipped = {"changes": changes, "unresolved_code_segments": _site_unresolved(outcome, changes)}
            break
        t0 = time.perf_counter()
        outcome = recompute(new)
        seconds = time.perf_counter() - t0
        mismatched, rtn = totals(outcome)
        passes.append({"changes": changes, "mismatched_values": mismatched, "rtn_mismatched_values": rtn,
                       "mismatch_removed_vs_rtn": 1 - mismatched / rtn if rtn else None,
                       "residual_by_site": ctl.residuals(), "rates_version": new.rates_version,
                       "seconds": round(seconds, 1),
                       # the changed sites' unresolved code segments after this pass (the next decision's input)
                       "unresolved_code_segments": _site_unresolved(outcome, changes),
                       "futile_sites_run_anyway": futile})
        config = new
        if mismatched >= best[0]:
            # more bits that leave more mismatches: the residual is not the code rate's (segments the
            # decode's search cannot reach: more syndrome bits turn wrong guesses into unresolved
            # segments at the trainer's own rounding). Keep the best rates and stop.
            passes[-1]["kept"] = False
            stopped = "a pass left no fewer mismatches than the best (not kept)"
            break
        passes[-1]["kept"] = True
        best = (mismatched, config, outcome)
    if passes:
        passes[-1]["next"] = "stop: " + stopped
    return best[1], best[2], passes, {"stopped": stopped, "skipped": skipped}
