"""The rate controller: each site's sparse rates follow its measured residual (closed loop).

Fixed rates tuned on one model under-correct another's deeper layers, where the trainer's own rounding
flips more codes. The trainer measures, per layer and site and every step, the audited residual
(audit.py: guided codes vs the full codes of a sample of tokens) and the segments its decode could not
resolve (counters.py). The controller accumulates those counts until a site has enough audited values
to tell its residual from the target, then

  raises  the code rate (2 bits, 4 when the residual is 4x the target or more) when the audited residual
          exceeds `target`, and the scale rate by one when unresolved scale segments alone exceed it;
  lowers  the code rate by one bit when the residual is below `target * lower_ratio` and no segment
          was unresolved (hysteresis: raise fast, lower slowly, never to below `min_code_bits`).

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
    min_values: int = 4000  # audited values a site needs before its residual is acted on
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
        for (layer, site), c in sorted(self.pending.items()):
            if config.layer_mode(layer, shape.num_layers) != "sparse" or site not in shape.layer_sites(layer):
                continue
            K = shape.row_shape(site)[-1]
            seg = segment(K)
            r = layer_rates(config, layer, site, K)
            if r.check:
                continue
            values, segs = c["audit_values"], max(c["sparse_segments"], 1)
            unresolved_scales = c["sparse_unresolved_scale_segments"] / segs
            if values < self.min_values:
                # Too few audited values to tell the residual from the target yet; unresolved segments
                # alone can still ask for more (each one is a whole segment kept at the trainer's rounding).
                residual = None
                unresolved = c["sparse_unresolved_code_segments"] * seg / max(segs * seg, 1)
                if unresolved <= self.target:
                    continue
                residual = unresolved
            else:
                residual = c["audit_mismatch"] / values
            code, scale = r.code_bits, r.scale_bits
            if residual > self.target:
                code = min(code + (4 if residual >= 4 * self.target else 2), seg // 2)
                if unresolved_scales > self.target:
                    scale = min(scale + 1, seg // BLOCK_SIZE, 4)
            elif (residual < self.target * self.lower_ratio and c["sparse_unresolved_code_segments"] == 0
                  and c["sparse_unresolved_scale_segments"] == 0):
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
