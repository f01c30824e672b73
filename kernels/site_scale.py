"""The global amax of a captured activation site: the one decision every engine and the trainer share.

`site_amax(config, layer, site, x)` is what the vLLM plugin (expert inputs, K/V), the SGLang plugin
(expert inputs, K/V) and the Megatron trainer (round-to-nearest rows) quantize a site with:
  activation_scale="per_token"  each row's own amax (batch invariant), float32 `x.shape[:-1]`
  activation_scale="static"     the calibrated `static_activation_amax["<layer>.<site>"]`, broadcast
                                to `x.shape[:-1]`
If each caller chose by itself, a static config would be honoured by some paths and not others, and
their codes would differ on identical inputs.

A static amax can be below a row's values: those values saturate (block scale 448, code +-6), as the
NVFP4 contract says. That is never silent: pass a `SaturationCounter` and the values above the amax
are counted per site, on the data's device (no host sync; `counts()` reads them when asked). Per-token
amax cannot saturate, so nothing is computed for it.
"""

import torch

from .api import row_amax


def count_saturated(x: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """int64 0-d tensor on x's device: elements of `x` whose magnitude exceeds their row's global amax
    (one element, or one per row `x.shape[:-1]`), i.e. the values round-to-nearest saturates. NaN is not
    counted (a NaN block is marked by its NaN scale byte instead)."""
    amax = global_amax if global_amax.numel() == 1 else global_amax.reshape(*x.shape[:-1], 1)
    return (x.abs() > amax.to(x.device)).sum()


class SaturationCounter:
    """Values above a static amax, per `"<layer>.<site>"`, accumulated where the data lives."""

    def __init__(self):
        self._acc: dict[str, torch.Tensor] = {}

    def add(self, layer: int, site: str, x: torch.Tensor, global_amax: torch.Tensor) -> None:
        n = count_saturated(x.detach(), global_amax)
        key = f"{layer}.{site}"
        acc = self._acc.get(key)
        if acc is None or acc.device != n.device:
            self._acc[key] = n if acc is None else n + acc.to(n.device)
        else:
            acc.add_(n)

    def counts(self) -> dict[str, int]:
        """`{"<layer>.<site>": values above the static amax}` (reads device counters: a sync on GPU)."""
        return {k: int(v) for k, v in sorted(self._acc.items())}

    def total(self) -> int:
        return sum(self.counts().values())

    def reset(self) -> None:
        self._acc.clear()


def site_amax(config, layer: int, site: str, x: torch.Tensor, *, saturated: SaturationCounter | None = None) -> torch.Tensor:
    """float32 `x.shape[:-1]`: the global amax of every row of `x` at `site` of `layer` under `config`
    (a `TraceConfig`; None = per token). Static mode counts saturated values into `saturated`."""
    if config is None or config.activation_scale != "static":
        return row_amax(x)
    amax = config.activation_amax(layer, site, x.device)
    if saturated is not None:
        saturated.add(layer, site, x, amax)
    return amax.expand(x.shape[:-1]).contiguous()
