"""The rate controller: each site's sparse rates follow its measured residual (closed loop).

Fixed rates tuned on one model under-correct another's deeper layers, where the trainer's own rounding
flips more codes. The trainer measures, per layer and site and every step, the audited residual
(audit.py: guided codes vs the full codes of a sample of tokens) and the segments its decode could not
resolve (counters.py). The controller accumulates those counts per site until they decide something:

  raises  the code rate (2 bits, 4 when the residual is 4x the target or more) once the audit has seen
          at least `min_mismatches` mismatches and the audited residual exceeds `target` (or, before
          the audit has seen enough, when unresolved segments alone exceed it), and the scale rate by one
          when unresolved scale segments exceed it;
  lowers  the code rate by one bit once the audit has seen enough values to bound the residual below
          `target * lower_ratio` (min_mismatches / (target * lower_ratio) values) with fewer mismatches
          than that and no unresolved segment (hysteresis: raise fast, lower slowly, never below
          `min_code_bits`).
Until then the counts keep adding up over steps (a 1% audit of a small batch sees few values).

A change makes a new TraceConfig (sparse_rates updated, rates_version + 1) that the engine takes with the
next weight sync; records made before it still decode (each payload carries its own rates). Check-only
sites (moe_fc2_in) are left alone: a disagreement there means the trainer did not reproduce the engine's
values, which no rate can fix; it is counted as unresolved by the decoder.
"""

import dataclasses
from dataclasses import dataclass, field

from ...format import BLOCK_SIZE
from .rates import layer_rates, segment

COUNTS = ("audit_values", "audit_mismatch", "audit_mismatch_rtn", "sparse_segments",
          "sparse_unresolved_code_segments", "sparse_unresolved_scale_segments")


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
    lower_ratio: float = 0.1  # lower a site's rate when its residual is below target * lower_ratio
    min_mismatches: int = 3  # audited mismatches a raise needs (fewer is not evidence of a residual above target)
    min_code_bits: int = 6
    pending: dict = field(default_factory=dict)  # (layer, site) -> counts accumulated since its last decision
    history: list = field(default_factory=list)  # every change: {"site", "from", "to", "residual", "version"}

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
            low = self.target * self.lower_ratio
            residual = c["audit_mismatch"] / values if values else None
            raise_it = residual is not None and c["audit_mismatch"] >= self.min_mismatches and residual > self.target
            lower_it = (values >= self.min_mismatches / low and c["audit_mismatch"] < self.min_mismatches
                        and residual < low)
            unresolved = (c["sparse_unresolved_code_segments"] + c["sparse_unresolved_scale_segments"]) / segs
            if not raise_it and unresolved > self.target:
                # the audit has not seen enough yet, but whole segments the decode kept at the trainer's
                # rounding already say the rate is short
                raise_it, residual = True, max(residual or 0.0, unresolved)
            if not (raise_it or lower_it):
                continue  # keep adding up
            code, scale = r.code_bits, r.scale_bits
            if raise_it:
                code = min(code + (4 if residual >= 4 * self.target else 2), seg // 2)
                if unresolved_scales > self.target:
                    scale = min(scale + 1, seg // BLOCK_SIZE, 4)
            elif c["sparse_unresolved_code_segments"] == 0 and c["sparse_unresolved_scale_segments"] == 0:
                code = max(code - 1, self.min_code_bits)
            self.pending.pop((layer, site))
            if (code, scale) != (r.code_bits, r.scale_bits):
                rates[f"{layer}.{site}"] = [r.amax_bits, scale, code]
                changes.append({"site": f"{layer}.{site}", "from": [r.amax_bits, r.scale_bits, r.code_bits],
                                "to": [r.amax_bits, scale, code], "residual": residual,
                                "audit_values": values})
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


__all__ = ["RateController", "bits_per_value_change", "site_counts"]
