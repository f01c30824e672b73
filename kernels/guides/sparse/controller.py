"""The rate controller: each site's sparse rates follow its measured residual (closed loop).

Fixed rates tuned on one model under-correct another's deeper layers, where the trainer's own rounding
flips more codes. The trainer measures, per layer and site and every step, the audited residual
(audit.py: guided codes vs the full codes of a sample of tokens) and the segments its decode could not
resolve (counters.py). The controller accumulates those counts per site until they decide something:

  raises  the code rate once the audit has seen at least `min_mismatches` mismatches and the audited
          residual exceeds the site's target (or, before the audit has seen enough, when unresolved
          segments alone exceed it), by the bits that bring the measured residual under the target
          (`raise_step`: a misdecoded segment needs a wrong pattern with the right syndrome, and each
          code bit halves the syndromes a wrong pattern can share, so log2(residual / target) bits,
          1..`max_step`), to at least the rate its measured flip density needs (`code_bits_for_density`),
          and the scale rate by one when unresolved scale segments exceed it; the amax coset bits by one
          where the counts show rows with a wrong amax (`amax_mismatch_rows`, align's). A check-only site's
          residual (moe_fc2_in: its rows differ only where the same layer's fc1 codes were wrong) is
          charged to the site that feeds it (`UPSTREAM`);
  lowers  the code rate by one bit once the audit has seen enough values to bound the residual below
          `target * lower_ratio` (min_mismatches / (target * lower_ratio) values) with fewer mismatches
          than that and no unresolved segment (hysteresis: raise fast, lower slowly, never below
          `min_code_bits`).
Until then the counts keep adding up over steps (a 1% audit of a small batch sees few values).

A change makes a new TraceConfig (sparse_rates updated, rates_version + 1) that the engine takes with the
next weight sync; records made before it still decode (each payload carries its own rates). A check-only
site's own rates never move (its syndromes are a checksum; a disagreement is counted as unresolved by the
decoder); its residual is the upstream site's to fix.

A site's target is `target` (a share of its values) or, with `relative_target` (the default), that share
of the site's RTN flips where smaller: the goal is stated as the share of RTN's mismatches removed.
"""

import dataclasses
import math
from dataclasses import dataclass, field

from ...format import BLOCK_SIZE
from .rates import layer_rates, segment

# A check-only site's rows equal the rollout's wherever the site feeding it decoded right: its residual is
# that site's, charged to it (moe_fc2_in is computed from the same layer's fc1 codes by the engine's GEMM).
UPSTREAM = {"moe_fc2_in": "moe_fc1_in"}

# The flip density the built-in code rates were tuned at (share of values the trainer's own rounding
# flips against the rollout, every earlier site guided): 1.3-2.9% on the two tiny models and the first
# layers of the held-out 8-layer model (docs/measurements.md), where 16 bits at fc1 and 11 at k / v
# (segments of 32) leave at most a few rows wrong. The BCH core of H (parity.py, distance 5) tells apart every pattern of <= 2 flips, so
# what the decode can get wrong is the segments of 3 or more flips.
REFERENCE_DENSITY = 0.03
REFERENCE_BITS = {64: 16, 32: 11, 16: 6}


def _p_three_or_more(lam: float) -> float:
    """P(a Poisson(lam) count >= 3): the share of segments with more flips than the BCH core separates."""
    return 1.0 - math.exp(-lam) * (1.0 + lam + lam * lam / 2.0)


def code_bits_for_density(density: float, seg: int) -> int:
    """The code bits a segment of `seg` values needs at flip density `density`: the reference rate plus
    log2 of how many more segments carry >= 3 flips (each bit halves the wrong patterns that share a
    syndrome), rounded up, at most seg // 2. A prior from the code's structure, used as a floor when a
    site is raised (and never lowered below): the measured residual (`raise_step`) decides the rest.
    The Poisson tail saturates at high density, where the decode's search, not the rate, is the limit."""
    ref = REFERENCE_BITS[seg]
    if density <= 0:
        return max(ref - 4, 1)
    ratio = _p_three_or_more(seg * density) / _p_three_or_more(seg * REFERENCE_DENSITY)
    return max(1, min(seg // 2, ref + math.ceil(math.log2(ratio) - 1e-9)))


def raise_step(residual: float, target: float, max_step: int = 4) -> int:
    """Code bits that bring a measured `residual` under `target` (1..max_step): log2 of their ratio."""
    if residual <= target:
        return 0
    if target <= 0:  # a relative target of a site with no RTN flip: any residual is unboundedly above it
        return max_step
    return max(1, min(max_step, math.ceil(math.log2(residual / target) - 1e-9)))


COUNTS = ("audit_values", "audit_mismatch", "audit_mismatch_rtn", "sparse_segments",
          "sparse_unresolved_code_segments", "sparse_unresolved_scale_segments", "amax_mismatch_rows",
          "amax_row_mismatch")
# rows whose decoded amax is not the rollout's (where the counts carry them: align measures them against
# the full records) that raise a site's amax coset bits by one: the trainer's amax key lies further from the
# rollout's than the coset and its list decode reach (a whole row wrong each time)
AMAX_RAISE_ROWS = 2
MAX_AMAX_BITS = 6


def site_counts(metrics: dict[str, float], prefix: str = "trace") -> dict[tuple[int, str], dict[str, float]]:
    """Per (layer, site): the counts the controller reads, from `BatchCounters.metrics()`'s flat names
    (`<prefix>/layer<L>/<site>/<count>`)."""
    out: dict[tuple[int, str], dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) != 4 or parts[0] != prefix or not parts[1].startswith("layer") or parts[3] not in COUNTS:
            continue
        if not parts[1][5:].isdigit():
            continue
        out.setdefault((int(parts[1][5:]), parts[2]), {})[parts[3]] = float(value)
    return out


@dataclass
class RateController:
    target: float = 1e-3  # audited residual (share of values) a site may keep
    # and, where set, at most this share of its RTN flips (audit_mismatch_rtn): the goal is stated as a
    # share of the mismatches RTN would leave (99% removed), so a site of high flip density may keep more
    # (0.5%: half of what the 99% goal allows, for the sampling error of few token rows; None: `target` alone)
    relative_target: float | None = 0.005
    max_step: int = 4  # code bits one decision raises a site by at most
    lower_ratio: float = 0.1  # lower a site's rate when its residual is below target * lower_ratio
    min_mismatches: int = 3  # audited mismatches a raise needs (fewer is not evidence of a residual above target)
    min_code_bits: int = 6
    pending: dict = field(default_factory=dict)  # (layer, site) -> counts accumulated since its last decision
    history: list = field(default_factory=list)  # every change: {"site", "from", "to", "residual", "version"}

    def site_target(self, density: float | None) -> float:
        """The residual a site of RTN flip density `density` may keep."""
        if self.relative_target is None or density is None:
            return self.target
        return min(self.target, self.relative_target * density)

    def observe(self, metrics: dict[str, float], prefix: str = "trace") -> None:
        """Add one step's counts (the flat metrics of trace_megatron's BatchCounters)."""
        for key, counts in site_counts(metrics, prefix).items():
            acc = self.pending.setdefault(key, dict.fromkeys(COUNTS, 0.0))
            for name in COUNTS:
                acc[name] += counts.get(name, 0.0)

    def residuals(self) -> dict[str, float | None]:
        """{"<layer>.<site>": audited residual of what has been observed since the last decision}."""
        return {f"{l}.{s}": (c["audit_mismatch"] / c["audit_values"] if c["audit_values"] else None)
                for (l, s), c in sorted(self.pending.items())}

    def update(self, config, shape):
        """(config with the new rates, or the same config when nothing changed; the changes made)."""
        rates = dict(config.sparse_rates)
        changes = []
        charged = {}  # (layer, upstream site) -> mismatches of the check-only sites it feeds
        for (layer, site), c in self.pending.items():
            if site in UPSTREAM:
                charged[(layer, UPSTREAM[site])] = charged.get((layer, UPSTREAM[site]), 0.0) + c["audit_mismatch"]
        for (layer, site), c in sorted(list(self.pending.items())):
            if config.layer_mode(layer, shape.num_layers) != "sparse" or site not in shape.layer_sites(layer):
                continue
            K = shape.row_shape(site)[-1]
            seg = segment(K)
            r = layer_rates(config, layer, site, K)
            if r.check:
                continue
            values, segs = c["audit_values"], max(c["sparse_segments"], 1)
            unresolved_scales = c["sparse_unresolved_scale_segments"] / segs
            density = c["audit_mismatch_rtn"] / values if values else None
            target = self.site_target(density)
            low = target * self.lower_ratio
            # mismatches in rows with a wrong amax are the amax's (raised below), not the codes'
            mismatch = c["audit_mismatch"] - c["amax_row_mismatch"] + charged.get((layer, site), 0.0)
            residual = mismatch / values if values else None
            raise_it = residual is not None and mismatch >= self.min_mismatches and residual > target
            # A site whose audit saw no RTN flip has a relative target of 0: no residual is far below it,
            # so it is never lowered (and nothing divides by it); a guided mismatch there still raises it.
            lower_it = (low > 0 and values >= self.min_mismatches / low and mismatch < self.min_mismatches
                        and residual < low)
            unresolved = (c["sparse_unresolved_code_segments"] + c["sparse_unresolved_scale_segments"]) / segs
            if not raise_it and unresolved > target:
                # the audit has not seen enough yet, but whole segments the decode kept at the trainer's
                # rounding already say the rate is short
                raise_it, residual = True, max(residual or 0.0, unresolved)
            amax = r.amax_bits
            if r.amax_bits and c["amax_mismatch_rows"] >= AMAX_RAISE_ROWS:
                amax = min(r.amax_bits + 1, MAX_AMAX_BITS)
            if not (raise_it or lower_it or amax != r.amax_bits):
                continue  # keep adding up
            code, scale = r.code_bits, r.scale_bits
            floor = code_bits_for_density(density, seg) if density is not None else code
            if raise_it:
                code = min(max(code + raise_step(residual, target, self.max_step), floor), seg // 2)
                if unresolved_scales > target:
                    scale = min(scale + 1, seg // BLOCK_SIZE, 4)
            elif lower_it and c["sparse_unresolved_code_segments"] == 0 and c["sparse_unresolved_scale_segments"] == 0:
                code = max(code - 1, self.min_code_bits, min(floor, code))
            self.pending.pop((layer, site))
            if (amax, code, scale) != (r.amax_bits, r.code_bits, r.scale_bits):
                rates[f"{layer}.{site}"] = [amax, scale, code]
                changes.append({"site": f"{layer}.{site}", "from": [r.amax_bits, r.scale_bits, r.code_bits],
                                "to": [amax, scale, code], "residual": residual,
                                "target": target, "flip_density": density,
                                "charged_from_downstream": charged.get((layer, site), 0.0), "audit_values": values})
        if not changes:
            return config, []
        new = dataclasses.replace(config, sparse_rates=rates, rates_version=config.rates_version + 1)
        for ch in changes:
            ch["version"] = new.rates_version
        self.history.extend(changes)
        return new, changes


def bits_per_value_change(old, new, shape) -> dict[str, float]:
    """{"<layer>.<site>": extra payload bits per captured value of the new rates over the old}."""
    out = {}
    for layer in range(shape.num_layers):
        for site in shape.layer_sites(layer):
            if new.layer_mode(layer, shape.num_layers) != "sparse":
                continue
            K = shape.row_shape(site)[-1]
            a, b = layer_rates(old, layer, site, K), layer_rates(new, layer, site, K)
            if a != b:
                seg = segment(K)
                out[f"{layer}.{site}"] = ((b.code_bits + b.scale_bits) - (a.code_bits + a.scale_bits)) / seg + \
                    (b.amax_bits - a.amax_bits) / K
    return out


def bits_per_value_change_by_layer(old, new, shape) -> dict[str, float]:
    """{"<layer>": extra payload bits per captured value of the whole model that the layer's new rates
    add over the old (its sites' changes, each weighted by the site's share of the model's values)."""
    per_site = bits_per_value_change(old, new, shape)
    sizes = {(l, s): math.prod(shape.row_shape(s)) for l in range(shape.num_layers) for s in shape.layer_sites(l)}
    total = sum(sizes.values())
    out: dict[str, float] = {}
    for key, bits in per_site.items():
        layer, site = key.split(".", 1)
        out[layer] = out.get(layer, 0.0) + bits * sizes[(int(layer), site)] / total
    return out


__all__ = ["RateController", "bits_per_value_change", "bits_per_value_change_by_layer", "code_bits_for_density",
           "raise_step", "site_counts"]
