"""Capture storage, following SGLang's routed-experts capturer (sglang/srt/state_capturer):

* a device staging buffer per forward, `[max tokens per forward, ...]`, written by the MoE method in the
  batch's token order;
* a host buffer indexed by KV slot, `[KV pool slots, ...]`, filled from the staging buffer at the end of
  each forward through `out_cache_loc` (the slots the forward's tokens were written to); the KV path
  writes its rows straight to their slots, which it is given;
* at request finish, the request's slots (`req_to_token[req_pool_idx][:seqlen - 1]`) are gathered.

CUDA graphs. SGLang's cuda graph runner captures the forward once per batch size and replays it, so
everything the forward does for the capture is a device write into the staging buffers
(`trace_kernels.engine.step_buffers.StepBuffers`: fixed addresses, rows [0, T), each key stamped with
the forward's number): the routed ids and MoE sites, the K/V rows and the KV slots they were written
to. Nothing in the forward leaves the device. `commit`, after the forward, checks the stamps (a key
the forward did not write is an error naming it, never stale rows) and moves the rows to the host.

Memory is bounded by the KV pool: one row per slot and site, overwritten when the slot is reused, so an
aborted or retracted request leaves nothing behind. Only guided layers keep sites (codes, scales, amax),
and only the sites the layer has (ModelShape.layer_sites: no moe sites in a dense layer, no K/V in a
linear-attention layer); every routed-expert layer keeps its routed expert ids (int16).
"""

from dataclasses import dataclass

import torch

from trace_kernels import BLOCK_SIZE, ModelShape, NVFP4Tensor
from trace_kernels.engine.step_buffers import ROUTING, StepBuffers

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

    def gather(self, index) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes[index], self.scales[index], self.amax[index])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.amax))


KV_LOC = "kv_loc"  # staging key of the KV slots a layer's K/V write went to


class CaptureBuffers:
    def __init__(self, shape: ModelShape, guided: list[bool], num_slots: int, max_tokens: int, device,
                 kv_layers: list[int] | None = None):
        self.shape = shape
        self.guided = guided
        # the layers whose K/V writes pass the FP4 hooks (BF16 boundary layers write theirs unquantized)
        self.kv_layers = shape.kv_layer_list() if kv_layers is None else list(kv_layers)
        self.num_slots = num_slots
        self.max_tokens = max_tokens
        L, k = shape.num_layers, shape.top_k
        self.host_routing = torch.zeros((num_slots, L, k), dtype=torch.int16)
        self.stage = StepBuffers(max_tokens)
        self.forwards = 0
        self.host: dict[tuple[int, str], SiteBuffer] = {}
        for layer in range(L):
            if not guided[layer]:
                continue
            for site in shape.layer_sites(layer):
                self.host[(layer, site)] = SiteBuffer.empty(num_slots, shape.row_shape(site), "cpu")

    def host_nbytes(self) -> int:
        return self.host_routing.numel() * 2 + sum(b.nbytes() for b in self.host.values())

    # ---- during a forward (device writes only: what a cuda graph replays) -----------------------
    def _check_fits(self, T: int) -> None:
        if T > self.max_tokens:
            raise RuntimeError(
                f"trace_fp4: a forward of {T} tokens exceeds the capture staging size {self.max_tokens} "
                "(max(chunked_prefill_size, max_running_requests))"
            )

    def stage_moe(self, layer: int, topk_ids: torch.Tensor, q1: NVFP4Tensor | None, q2: NVFP4Tensor | None):
        self._check_fits(topk_ids.shape[0])
        self.stage.write_routing(layer, topk_ids)
        if self.guided[layer]:
            self.stage.write_site(layer, "moe_fc1_in", q1)
            self.stage.write_site(layer, "moe_fc2_in", q2)

    def write_kv(self, layer: int, loc: torch.Tensor, qk: NVFP4Tensor, qv: NVFP4Tensor) -> None:
        """Stage a layer's K/V rows with the KV slots they go to (moved to the host at commit)."""
        self._check_fits(loc.shape[0])
        self.stage.write_tensor((KV_LOC, layer), loc.to(torch.int64))
        if self.guided[layer] and self.shape.has_kv(layer):
            self.stage.write_site(layer, "k", qk)
            self.stage.write_site(layer, "v", qv)

    def begin(self) -> None:
        """Before a forward: the stamp its writes carry."""
        self.forwards += 1
        self.stage.begin(self.forwards)

    # ---- after a forward -------------------------------------------------------------------------
    def expected_keys(self, with_kv: bool) -> list[tuple]:
        keys = [(ROUTING, i) for i in self.shape.moe_layer_list()]
        keys += [k for k in self.host if k[1] in MOE_SITES]
        if with_kv:
            keys += [(KV_LOC, i) for i in self.kv_layers]
            keys += [k for k in self.host if k[1] in KV_SITES]
        return keys

    def missing(self, T: int, with_kv: bool) -> list[tuple]:
        """Keys this forward (of T tokens) did not write."""
        return self.stage.missing(self.forwards, self.expected_keys(with_kv), T)

    def commit(self, out_cache_loc: torch.Tensor, with_kv: bool = True) -> None:
        """End of forward: staged rows [0, T) -> host rows by KV slot (T = len(out_cache_loc)); the
        MoE rows go to `out_cache_loc`, the K/V rows to the slots their write was given."""
        T = out_cache_loc.shape[0]
        keys = [k for k in self.expected_keys(with_kv) if k in self.stage.tensors]
        rows = self.stage.read(keys, 0, T)
        loc = out_cache_loc.to("cpu", torch.int64)
        routing = [i for i in self.shape.moe_layer_list() if (ROUTING, i) in rows]
        if routing:
            self.host_routing[loc.unsqueeze(1), torch.tensor(routing)] = torch.stack([rows[(ROUTING, i)] for i in routing], 1)
        for key, buf in self.host.items():
            if key not in rows:
                continue
            if key[1] in KV_SITES:
                buf.write(rows[(KV_LOC, key[0])], rows[key])
            else:
                buf.write(loc, rows[key])

    # ---- at request finish ---------------------------------------------------------------------
    def gather(self, slots: torch.Tensor):
        """Per layer: routed ids [n, top_k]; per guided (layer, site): NVFP4Tensor rows of `slots`."""
        slots = slots.to("cpu", torch.int64)
        routing = self.host_routing[slots]
        sites = {key: buf.gather(slots) for key, buf in self.host.items()}
        return routing, sites
