"""Capture storage, following SGLang's routed-experts capturer (sglang/srt/state_capturer):

* a device staging buffer per forward, `[max tokens per forward, ...]`, written by the MoE method in the
  batch's token order;
* a host buffer indexed by KV slot, `[KV pool slots, ...]`, filled from the staging buffer at the end of
  each forward through `out_cache_loc` (the slots the forward's tokens were written to); the KV path
  writes its rows straight to their slots, which it is given;
* at request finish, the request's slots (`req_to_token[req_pool_idx][:seqlen - 1]`) are gathered.

Memory is bounded by the KV pool: one row per slot and site, overwritten when the slot is reused, so an
aborted or retracted request leaves nothing behind. Only guided layers keep sites (codes, scales, amax),
and only the sites the layer has (ModelShape.layer_sites: no moe sites in a dense layer, no K/V in a
linear-attention layer); every routed-expert layer keeps its routed expert ids (int16).
"""

from dataclasses import dataclass

import torch

from trace_kernels import BLOCK_SIZE, ModelShape, NVFP4Tensor

MOE_SITES = ("moe_fc1_in", "moe_fc2_in")
KV_SITES = ("k", "v")


@dataclass
class SiteBuffer:
    codes: torch.Tensor  # uint8 [N, *lead, K // 2]
    scales: torch.Tensor  # uint8 [N, *lead, K // 16]
    amax: torch.Tensor  # float32 [N, *lead]

    @classmethod
    def empty(cls, n: int, row_shape: tuple[int, ...], device) -> "SiteBuffer":
        *lead, K = row_shape
        return cls(
            torch.zeros((n, *lead, K // 2), dtype=torch.uint8, device=device),
            torch.zeros((n, *lead, K // BLOCK_SIZE), dtype=torch.uint8, device=device),
            torch.zeros((n, *lead), dtype=torch.float32, device=device),
        )

    def write(self, index, q: NVFP4Tensor) -> None:
        """Rows `index` (a slice or a tensor of row ids) <- q ([n, *row_shape])."""
        lead = q.codes.shape[:-1]
        amax = q.global_amax.to(torch.float32)
        amax = amax.reshape(1).expand(lead) if amax.numel() == 1 else amax.reshape(lead)
        self.codes[index] = q.codes
        self.scales[index] = q.scales
        self.amax[index] = amax

    def copy_rows(self, dst: "SiteBuffer", src_rows: slice, dst_index) -> None:
        dst.codes[dst_index] = self.codes[src_rows].to(dst.codes.device)
        dst.scales[dst_index] = self.scales[src_rows].to(dst.scales.device)
        dst.amax[dst_index] = self.amax[src_rows].to(dst.amax.device)

    def gather(self, index) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes[index], self.scales[index], self.amax[index])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.amax))


class CaptureBuffers:
    def __init__(self, shape: ModelShape, guided: list[bool], num_slots: int, max_tokens: int, device):
        self.shape = shape
        self.guided = guided
        self.num_slots = num_slots
        self.max_tokens = max_tokens
        L, k = shape.num_layers, shape.top_k
        self.host_routing = torch.zeros((num_slots, L, k), dtype=torch.int16)
        self.stage_routing = torch.zeros((max_tokens, L, k), dtype=torch.int16, device=device)
        self.host: dict[tuple[int, str], SiteBuffer] = {}
        self.stage: dict[tuple[int, str], SiteBuffer] = {}
        for layer in range(L):
            if not guided[layer]:
                continue
            for site in shape.layer_sites(layer):
                if site in MOE_SITES:
                    self.stage[(layer, site)] = SiteBuffer.empty(max_tokens, shape.row_shape(site), device)
                self.host[(layer, site)] = SiteBuffer.empty(num_slots, shape.row_shape(site), "cpu")

    def host_nbytes(self) -> int:
        return self.host_routing.numel() * 2 + sum(b.nbytes() for b in self.host.values())

    # ---- during a forward ----------------------------------------------------------------------
    def stage_moe(self, layer: int, topk_ids: torch.Tensor, q1: NVFP4Tensor | None, q2: NVFP4Tensor | None):
        T = topk_ids.shape[0]
        if T > self.max_tokens:
            raise RuntimeError(
                f"trace_fp4: a forward of {T} tokens exceeds the capture staging size {self.max_tokens} "
                "(max(chunked_prefill_size, max_running_requests))"
            )
        self.stage_routing[:T, layer] = topk_ids.to(torch.int16)
        if self.guided[layer]:
            self.stage[(layer, "moe_fc1_in")].write(slice(0, T), q1)
            self.stage[(layer, "moe_fc2_in")].write(slice(0, T), q2)

    def write_kv(self, layer: int, loc: torch.Tensor, qk: NVFP4Tensor, qv: NVFP4Tensor) -> None:
        if not self.guided[layer] or not self.shape.has_kv(layer):
            return
        loc = loc.to("cpu", torch.int64)
        self.host[(layer, "k")].write(loc, qk)
        self.host[(layer, "v")].write(loc, qv)

    def commit(self, out_cache_loc: torch.Tensor) -> None:
        """End of forward: staging rows [0, T) -> host rows out_cache_loc (T = its length)."""
        T = out_cache_loc.shape[0]
        loc = out_cache_loc.to("cpu", torch.int64)
        self.host_routing[loc] = self.stage_routing[:T].cpu()
        rows = slice(0, T)
        for key, buf in self.stage.items():
            buf.copy_rows(self.host[key], rows, loc)

    # ---- at request finish ---------------------------------------------------------------------
    def gather(self, slots: torch.Tensor):
        """Per layer: routed ids [n, top_k]; per guided (layer, site): NVFP4Tensor rows of `slots`."""
        slots = slots.to("cpu", torch.int64)
        routing = self.host_routing[slots]
        sites = {key: buf.gather(slots) for key, buf in self.host.items()}
        return routing, sites
