"""Capture mode (tests, debugging, a second engine's emulation): the codes this forward computed, by
flat token position, and the records built from them."""

import torch
from trace_kernels import GuidanceRecord, ModelShape, NVFP4Tensor, RecordBuilder, TraceConfig, quantize, row_amax

from .layout import TokenLayout


class CaptureBuffer:
    def __init__(self, shape: ModelShape, config: TraceConfig, layout: TokenLayout, *, keep_values: bool, perturb,
                 device: torch.device):
        self.shape, self.config, self.layout = shape, config, layout
        self.keep_values = keep_values  # also keep each row's unquantized input (analysis)
        self.perturb = perturb  # x -> x' quantized instead of x (a second engine's numerics)
        self.device = device
        self._captured: dict[tuple[int, str], dict] = {}
        self._routing_captured: dict[int, torch.Tensor] = {}

    def capture_rows(self, layer: int, site: str, positions: torch.Tensor, q: NVFP4Tensor, slots=None, values=None) -> None:
        key = (layer, site)
        buf = self._captured.get(key)
        N = self.layout.num_positions
        lead = (N, self.shape.top_k) if site == "moe_fc2_in" else (N,)
        if buf is None:
            buf = {
                "codes": torch.zeros(*lead, *q.codes.shape[1:], dtype=torch.uint8, device=q.codes.device),
                "scales": torch.zeros(*lead, *q.scales.shape[1:], dtype=torch.uint8, device=q.codes.device),
                "amax": torch.zeros(*lead, *q.codes.shape[1:-1], dtype=torch.float32, device=q.codes.device),
                "filled": torch.zeros(*lead, dtype=torch.bool, device=q.codes.device),
            }
            self._captured[key] = buf
        amax = q.global_amax if q.global_amax.numel() != 1 else q.global_amax.expand(q.codes.shape[:-1])
        index = (positions,) if slots is None else (positions, slots)
        # A token's moe_fc1_in row reaches each of its experts; the engine quantizes it once, so every
        # copy must carry the same codes.
        again = buf["filled"][index]
        if bool(again.any()) and not torch.equal(buf["codes"][index][again], q.codes[again]):
            raise RuntimeError(f"capture: layer {layer}, site {site}: one token row was quantized to different codes")
        buf["codes"][index] = q.codes
        buf["scales"][index] = q.scales
        buf["amax"][index] = amax.to(torch.float32)
        buf["filled"][index] = True
        if self.keep_values and values is not None:
            if "values" not in buf:
                buf["values"] = torch.zeros(
                    *lead, *q.codes.shape[1:-1], values.shape[-1], dtype=torch.float32, device=values.device
                )
            buf["values"][index] = values.detach().to(torch.float32).reshape(buf["values"][index].shape)

    def capture_routing(self, layer: int, positions: torch.Tensor, ids: torch.Tensor) -> None:
        buf = self._routing_captured.setdefault(
            layer, torch.full((self.layout.num_positions, ids.shape[1]), -1, dtype=torch.int64, device=ids.device)
        )
        buf[positions] = ids.to(torch.int64)

    def perturbed_quantize(self, x: torch.Tensor) -> NVFP4Tensor:
        """What a second engine would have captured: RTN of perturb(x), per-row amax."""
        xp = self.perturb(x.detach())
        return quantize(xp, row_amax(xp), block_scale=self.config.block_scale if self.config is not None else "6")

    def build_records(self, config: TraceConfig | None = None, *, token_ids=None, weights_version=None,
                      weights_digest: str | None = None) -> list[GuidanceRecord]:
        """One record per sample from what was captured, covering every token of the sample.

        `token_ids` (one sequence per sample, the ids this forward ran) and the weights fields become
        the records' identity (see trace_kernels.RecordIdentity)."""
        if self.layout.is_shard:
            raise RuntimeError(
                "trace_megatron: this capture ran on a context-parallel shard and holds part of each sample; "
                "a record covers a whole sample (capture on one CP rank, or compare per position: captured())"
            )
        config = config or self.config
        modes = config.layer_modes(self.shape.num_layers)
        records = []
        for i in range(self.layout.num_samples):
            pos = self.layout.positions_of(i).to(self.device)
            builder = RecordBuilder(self.shape, config, token_ids=None if token_ids is None else token_ids[i],
                                    weights_version=weights_version, weights_digest=weights_digest)
            for layer in range(self.shape.num_layers):
                if self.shape.has_moe(layer):  # dense-MLP layers have no routing (and no moe sites)
                    if layer not in self._routing_captured:
                        raise RuntimeError(f"layer {layer}: no routing was captured (is it an MoE layer of a trace spec?)")
                    builder.add_routing(layer, self._routing_captured[layer][pos].cpu())
                if modes[layer] is None:
                    continue
                for site in self.shape.layer_sites(layer):
                    buf = self._captured.get((layer, site))
                    if buf is None or not bool(buf["filled"][pos].all()):
                        raise RuntimeError(f"layer {layer}, site {site}: not every row of sample {i} was captured")
                    builder.add(layer, site, NVFP4Tensor(buf["codes"][pos].cpu(), buf["scales"][pos].cpu(), buf["amax"][pos].cpu()))
            records.append(builder.build())
        return records

    def captured(self, layer: int, site: str) -> NVFP4Tensor:
        """The captured rows of (layer, site) by flat position ([N, ...]; fc2: [N, top_k, ...])."""
        buf = self._captured[(layer, site)]
        return NVFP4Tensor(buf["codes"], buf["scales"], buf["amax"])

    def captured_routing(self, layer: int) -> torch.Tensor:
        """int64 [N, top_k]: the expert ids this forward routed each flat position to (-1: not captured)."""
        return self._routing_captured[layer]

    def captured_values(self, layer: int, site: str) -> torch.Tensor:
        """The unquantized inputs of (layer, site) by flat position, float32 (capture with keep_values)."""
        buf = self._captured[(layer, site)]
        if "values" not in buf:
            raise RuntimeError("captured_values needs trace_megatron.capture(..., keep_values=True)")
        return buf["values"]
