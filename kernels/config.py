"""TraceConfig: the one configuration shared by the engine plugins and the trainer.

It can be built in Python, or read from a model's `quantization_config` (config.json) where
`quant_method` is `trace_fp4`. Unknown keys and bad values raise `ValueError` naming them.
"""

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .format import BLOCK_SCALES

GuidanceMode = Literal["full", "compact", "sparse"]
GUIDANCE_MODES = ("full", "compact", "sparse")
# The captured sites of a standard layer (routed experts + K/V). MLA layers cache one latent row per
# token instead of K and V: site "kv_latent" (records.ModelShape says which sites each layer has).
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")
MOE_SITES = ("moe_fc1_in", "moe_fc2_in")
KV_SITES = ("k", "v", "kv_latent")
ALL_SITES = SITES + ("kv_latent",)
QUANT_METHOD = "trace_fp4"


@dataclass(frozen=True)
class TraceConfig:
    # What is quantized to NVFP4 (everything else stays in the model's dtype).
    quantize_expert_weights: bool = True
    quantize_expert_inputs: bool = True
    quantize_kv: bool = True
    # Whether the engine records guidance (codes and scales of the captured sites).
    capture: bool = True
    # Guidance per layer: `guided_layers` are guided with `guidance`, except `full_layers` (full).
    # "deeper_half" = layers num_layers // 2 .. num_layers - 1. Default: sparse guidance at every layer
    # (kernels/guides/sparse; measured by `trace-fp4 align` on the embedded and a trained tiny model: 0.38
    # bits per captured value, >= 99.8% of the trainer's own RTN mismatches removed, |delta logp|
    # 0.98-1.0x of full guidance's). The paper's default (compact, deeper half) is PAPER_CONFIG: 3.4x the bits and
    # the shallow half unguided, which leaves ~9% codeword mismatch on the tiny model.
    guidance: GuidanceMode = "sparse"
    guided_layers: str | tuple[int, ...] = "all"
    full_layers: tuple[int, ...] = ()
    # Activation global amax: per token (batch invariant, default) or static per layer and site,
    # calibrated offline: {"<layer>.<site>": amax}.
    activation_scale: Literal["per_token", "static"] = "per_token"
    static_activation_amax: dict[str, float] = field(default_factory=dict)
    # BF16 boundary layers: their routed experts (weights and inputs) and K/V stay unquantized in the
    # engines and the trainer, and records hold no rows for them (verl keeps the first 2 and last 4,
    # miles the last ~15%). Left out of `to_dict` while empty, so configs without it serialise as before.
    bf16_layers: tuple[int, ...] = ()
    # Block-scale rule of every NVFP4 tensor (weights, activations, K/V): "6" maps each 16-value block's
    # amax to 6 (the numerics contract); "4over6" (Four Over Six, arXiv 2512.02010) uses the global scale
    # 6 * 256 / amax and per block the scale mapping its amax to 4 where that has the strictly lower
    # squared error (trace_kernels.format, docs/four_over_six.md). Left out of `to_dict` while "6".
    block_scale: str = "6"
    # Sparse guidance rates per layer and site, {"<layer>.<site>": [amax_bits, scale_bits, code_bits]}:
    # overrides of the built-in per-site rates (kernels/guides/sparse/rates.py), set by the rate
    # controller (kernels/guides/sparse/controller.py) from the audited residual. Every sparse payload
    # also carries the rates it was encoded with, so the trainer never needs these to decode.
    sparse_rates: dict[str, list[int]] = field(default_factory=dict)
    # Fraction of each sparse record's token rows whose full codes ride along as an audit (rows chosen
    # by a seed both sides derive from the record's identity): the trainer's measure of the residual
    # mismatch sparse guidance leaves, which the rate controller acts on. 0: no audit. 0.25%: the audit
    # costs ~0.012 bits per value, what the 0.4 b/v budget leaves beside the syndromes (0.384-0.39 b/v
    # on the tiny models; 1% cost 0.047 and put both at 0.43); its power comes from the rollouts of a
    # step and of several steps together (the controller waits for >= 3 audited mismatches), not from
    # one record.
    sparse_audit: float = 0.0025
    # Bumped by the rate controller each time it changes sparse_rates (a new config the engine takes with
    # the next weight sync); records name the version they were made with.
    rates_version: int = 0

    def __post_init__(self):
        for name in ("quantize_expert_weights", "quantize_expert_inputs", "quantize_kv", "capture"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TraceConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.guidance, str) or self.guidance not in GUIDANCE_MODES:
            raise ValueError(f"TraceConfig.guidance must be one of {GUIDANCE_MODES}, got {self.guidance!r}")
        # Layer lists are normalised (sorted, deduplicated tuples) so that configs meaning the same thing
        # compare equal: a record made with [2, 1] serves a trainer configured with [1, 2].
        if isinstance(self.guided_layers, str):
            if self.guided_layers not in ("deeper_half", "all", "none"):
                raise ValueError(
                    "TraceConfig.guided_layers must be 'deeper_half', 'all', 'none' or a list of layer "
                    f"indices, got {self.guided_layers!r}"
                )
        else:
            object.__setattr__(self, "guided_layers", _layer_tuple("guided_layers", self.guided_layers))
        object.__setattr__(self, "full_layers", _layer_tuple("full_layers", self.full_layers))
        object.__setattr__(self, "bf16_layers", _layer_tuple("bf16_layers", self.bf16_layers))
        if self.block_scale not in BLOCK_SCALES:
            raise ValueError(f"TraceConfig.block_scale must be one of {BLOCK_SCALES}, got {self.block_scale!r}")
        both = sorted(set(self.full_layers) & set(self.bf16_layers))
        if both:
            raise ValueError(f"TraceConfig: layers {both} are in both full_layers and bf16_layers (a BF16 layer has no FP4 guidance)")
        if self.activation_scale not in ("per_token", "static"):
            raise ValueError(
                f"TraceConfig.activation_scale must be 'per_token' or 'static', got {self.activation_scale!r}"
            )
        if not isinstance(self.static_activation_amax, dict):
            raise ValueError(
                "TraceConfig.static_activation_amax must be a mapping {'<layer>.<site>': amax}, got "
                f"{type(self.static_activation_amax).__name__}"
            )
        if self.activation_scale == "static" and not self.static_activation_amax:
            raise ValueError("TraceConfig.activation_scale='static' needs static_activation_amax")
        if self.activation_scale != "static" and self.static_activation_amax:
            raise ValueError(
                "TraceConfig.static_activation_amax is set but activation_scale is "
                f"{self.activation_scale!r}: the values would be ignored; set activation_scale='static'"
            )
        amax = {}
        for key, value in self.static_activation_amax.items():
            layer, _, site = key.partition(".") if isinstance(key, str) else ("", "", "")
            if not (layer.isascii() and layer.isdigit()) or site not in ALL_SITES:
                raise ValueError(
                    f"TraceConfig.static_activation_amax key {key!r}: expected '<layer>.<site>' with site "
                    f"in {ALL_SITES}"
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
                # the value is used as a float32: it must stay finite and non-zero there too
                or not 0 < float(torch.tensor(float(value), dtype=torch.float32)) < math.inf
            ):
                raise ValueError(
                    f"TraceConfig.static_activation_amax[{key!r}] must be a finite number > 0 (in float32), "
                    f"got {value!r}"
                )
            norm = f"{int(layer)}.{site}"
            if norm in amax:
                raise ValueError(f"TraceConfig.static_activation_amax has two entries for {norm!r}")
            amax[norm] = float(value)
        object.__setattr__(self, "static_activation_amax", dict(sorted(amax.items())))
        object.__setattr__(self, "sparse_rates", _sparse_rates(self.sparse_rates))
        if (isinstance(self.sparse_audit, bool) or not isinstance(self.sparse_audit, (int, float))
                or not 0 <= self.sparse_audit <= 1):
            raise ValueError(f"TraceConfig.sparse_audit must be a fraction of rows in [0, 1], got {self.sparse_audit!r}")
        object.__setattr__(self, "sparse_audit", float(self.sparse_audit))
        if isinstance(self.rates_version, bool) or not isinstance(self.rates_version, int) or self.rates_version < 0:
            raise ValueError(f"TraceConfig.rates_version must be a non-negative int, got {self.rates_version!r}")

    def check_layers(self, num_layers: int, *, where: str = "the model", shape=None) -> None:
        """Raise ValueError unless every layer this config names exists in a model of `num_layers`
        layers, and (static mode) every quantized activation site of every layer has its amax. With a
        `shape` (records.ModelShape) the sites are that model's, layer by layer.

        Called by the engine plugins at start and by the trainer when it builds its specs, so a
        config for another model fails there instead of being partly ignored."""
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
            raise ValueError(f"TraceConfig.check_layers: num_layers must be a positive int, got {num_layers!r}")
        bad = {}
        if not isinstance(self.guided_layers, str):
            bad["guided_layers"] = [i for i in self.guided_layers if i >= num_layers]
        bad["full_layers"] = [i for i in self.full_layers if i >= num_layers]
        bad["bf16_layers"] = [i for i in self.bf16_layers if i >= num_layers]
        bad["static_activation_amax"] = [
            k for k in self.static_activation_amax if int(k.partition(".")[0]) >= num_layers
        ]
        bad["sparse_rates"] = [k for k in self.sparse_rates if int(k.partition(".")[0]) >= num_layers]
        for name, out in bad.items():
            if out:
                raise ValueError(
                    f"TraceConfig.{name} names {out} but {where} has {num_layers} layers (0..{num_layers - 1})"
                )
        if self.activation_scale == "static":
            def quantized(site):
                return self.quantize_expert_inputs if site in MOE_SITES else self.quantize_kv

            layer_sites = (lambda i: shape.layer_sites(i)) if shape is not None else (lambda i: SITES)
            missing = [f"{i}.{s}" for i in range(num_layers) if i not in self.bf16_layers for s in layer_sites(i)
                       if quantized(s) and f"{i}.{s}" not in self.static_activation_amax]
            if missing:
                shown = ", ".join(missing[:6]) + (f", ... ({len(missing)} in all)" if len(missing) > 6 else "")
                raise ValueError(
                    f"TraceConfig.activation_scale='static' but static_activation_amax has no entry for {shown} "
                    f"({where} has {num_layers} layers; every quantized site needs its amax)"
                )

    def layer_mode(self, layer: int, num_layers: int) -> GuidanceMode | None:
        """Guidance mode of `layer` in a model of `num_layers` layers; None = not guided (RTN, or BF16)."""
        if layer in self.bf16_layers:
            return None
        if layer in self.full_layers:
            return "full"
        if self.guided_layers == "all":
            guided = True
        elif self.guided_layers == "none":
            guided = False
        elif self.guided_layers == "deeper_half":
            guided = layer >= num_layers // 2
        else:
            guided = layer in self.guided_layers
        return self.guidance if guided else None

    def layer_modes(self, num_layers: int) -> list[GuidanceMode | None]:
        return [self.layer_mode(i, num_layers) for i in range(num_layers)]

    def is_bf16_layer(self, layer: int) -> bool:
        return layer in self.bf16_layers

    def for_layer(self, layer: int) -> "TraceConfig":
        """What `layer` quantizes: this config, or for a BF16 boundary layer the same config with its
        experts and K/V unquantized (the engines hand it to that layer's MoE and attention methods)."""
        if layer not in self.bf16_layers:
            return self
        return dataclasses.replace(self, quantize_expert_weights=False, quantize_expert_inputs=False, quantize_kv=False)

    def activation_amax(self, layer: int, site: str, device=None):
        """The global amax an engine quantizes `site` of `layer` with: None means per token (each row's
        own amax, batch invariant); in static mode the calibrated float32 value (KeyError naming the
        missing entry)."""
        if self.activation_scale != "static":
            return None
        key = f"{layer}.{site}"
        if key not in self.static_activation_amax:
            raise KeyError(f"trace_fp4: static_activation_amax has no entry {key!r}")
        return torch.tensor([self.static_activation_amax[key]], dtype=torch.float32, device=device)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("guided_layers", "full_layers", "bf16_layers"):
            if isinstance(d[key], tuple):
                d[key] = list(d[key])
        if not d["bf16_layers"]:
            del d["bf16_layers"]  # the default: records and configs read and write exactly as before
        if d["block_scale"] == "6":
            del d["block_scale"]  # likewise
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TraceConfig":
        """Build from a plain dict; a `quant_method` key, if present, must say trace_fp4."""
        if not isinstance(d, dict):
            raise ValueError(f"a TraceConfig must be a mapping of settings, got {type(d).__name__}: {d!r:.80}")
        d = dict(d)
        method = d.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"quantization_config has quant_method={method!r}, expected {QUANT_METHOD!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TraceConfig key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**d)


def _sparse_rates(rates) -> dict[str, list[int]]:
    """{"<layer>.<site>": [amax_bits, scale_bits, code_bits]}, keys normalised and sorted."""
    if not isinstance(rates, dict):
        raise ValueError(f"TraceConfig.sparse_rates must be a mapping {{'<layer>.<site>': [amax, scale, code bits]}}, "
                         f"got {type(rates).__name__}")
    out = {}
    for key, value in rates.items():
        layer, _, site = key.partition(".") if isinstance(key, str) else ("", "", "")
        if not (layer.isascii() and layer.isdigit()) or site not in ALL_SITES:
            raise ValueError(f"TraceConfig.sparse_rates key {key!r}: expected '<layer>.<site>' with site in {ALL_SITES}")
        if (not isinstance(value, (list, tuple)) or len(value) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                or not (0 <= value[0] <= 8 and 0 <= value[1] <= 4 and 0 <= value[2] <= 62)):
            raise ValueError(f"TraceConfig.sparse_rates[{key!r}] must be [amax_bits 0..8, scale_bits 0..4, "
                             f"code_bits 0..62], got {value!r}")
        norm = f"{int(layer)}.{site}"
        if norm in out:
            raise ValueError(f"TraceConfig.sparse_rates has two entries for {norm!r}")
        out[norm] = [int(v) for v in value]
    return dict(sorted(out.items(), key=lambda kv: (int(kv[0].partition(".")[0]), kv[0])))


# What a sparse record's rates and audit may differ in from the trainer's config: the rates travel in
# every payload, so a record made one rate update ago still decodes exactly.
RATE_KEYS = ("sparse_rates", "sparse_audit", "rates_version")


def _layer_tuple(name: str, layers) -> tuple[int, ...]:
    """Sorted, deduplicated tuple of non-negative layer indices (a list, tuple or set)."""
    if isinstance(layers, (str, bytes, dict)) or not isinstance(layers, (list, tuple, set, frozenset)):
        raise ValueError(f"TraceConfig.{name} must be a list of non-negative layer indices, got {layers!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        raise ValueError(f"TraceConfig.{name} must be non-negative layer indices, got {sorted(layers, key=repr)!r}")
    return tuple(sorted(set(layers)))


# The TRACE paper's default: compact guidance (mantissa bit + scales) on the deeper half of the layers.
PAPER_CONFIG = TraceConfig(guidance="compact", guided_layers="deeper_half")
