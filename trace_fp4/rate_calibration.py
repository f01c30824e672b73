"""align's rate calibration: rates that follow the measured data, pass by pass, until the residual is
below its target.

align holds every record in full, so each trace_sparse recompute measures the true residual of every
layer and site (a 100% audit) and the flip density the trainer's own rounding leaves there (its RTN
mismatches at the same activations). The rate controller (kernels/guides/sparse/controller.py) turns
those counts into rates as it would a trainer's audit, with a target relative to each site's flip density
(the goal is a share of the mismatches RTN would leave), a raise of log2(residual / target) bits and the
density's code rate as a floor; a check-only site's residual (moe_fc2_in) is charged to the fc1 codes that
feed it. The recompute then runs again with the new rates, and again, until the whole model's residual is
at most `STOP_SHARE` of its RTN mismatches, or nothing moves, or `MAX_PASSES` passes ran. Only raises: one
align run is too few values to bound a residual low enough to lower a rate (the controller's lowering
needs ~10x more audited values than a site holds here; the RL loop lowers over many steps).
"""

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


def calibrate(base, outcome, shape, recompute, *, max_passes: int = MAX_PASSES, stop_share: float = STOP_SHARE,
              relative_target: float = RELATIVE_TARGET):
    """Passes of (measure, controller, recompute) from `outcome` (the recompute under `base`).
    `recompute(config)` runs trace_sparse with the records encoded under `config` and returns its outcome.
    Returns (the config of the lowest residual, its outcome, passes: one dict per recompute run, with
    the changes it made, its residual and whether it was kept: a pass whose residual is no lower than
    the best so far ends the calibration and is not kept)."""
    config, passes = base, []
    best = (totals(outcome)[0], config, outcome)
    for _ in range(max_passes):
        if below_target(outcome, stop_share):
            break
        ctl = RateController(relative_target=relative_target)
        ctl.observe(measured_counts(outcome))
        new, changes = ctl.update(config, shape)
        if not changes:
            break
        outcome = recompute(new)
        mismatched, rtn = totals(outcome)
        passes.append({"changes": changes, "mismatched_values": mismatched, "rtn_mismatched_values": rtn,
                       "mismatch_removed_vs_rtn": 1 - mismatched / rtn if rtn else None,
                       "residual_by_site": ctl.residuals(), "rates_version": new.rates_version})
        config = new
        if mismatched >= best[0]:
            # more bits that leave more mismatches: the residual is not the code rate's (segments the
            # decode's search cannot reach: more syndrome bits turn wrong guesses into unresolved
            # segments at the trainer's own rounding). Keep the best rates and stop.
            passes[-1]["kept"] = False
            break
        passes[-1]["kept"] = True
        best = (mismatched, config, outcome)
    return best[1], best[2], passes
