"""Static per-step capture buffers: what a forward writes, at fixed addresses, so a CUDA graph can replay it.

A CUDA graph replays kernels, not Python, so a capture that appends tensors to a Python store from inside
the forward would silently miss every replayed step. Instead (the pattern of vLLM's routed-experts
capturer): every capture key, `(layer, site)` for codes/scales/amax or `("routing", layer)` for the routed
expert ids, owns device buffers of `capacity` rows (the engine's maximum batched tokens). The forward
writes rows `[0, T)` of them with plain copies (no host synchronisation, no data-dependent shape) and
also writes the key's stamp `(step, T)`, read from a device step counter that the runner sets before
the forward. After the step, outside the forward, `read` copies the valid rows to the host (through
pinned staging and one stream synchronisation on CUDA), and `missing` lists the keys whose stamp is not
this step's: a step whose forward did not write a key (a replay that skipped it) makes a gap in the
record, and the caller refuses those requests' records instead of attributing stale rows.

Buffers are allocated on a key's first write with the row shape the forward produces there, so a
tensor-parallel rank sizes them for its own rows. vLLM's profiling run (the maximum batch, before any
graph is captured) makes that first write, so captured graphs point at buffers that already exist.

A write of more rows than `capacity` is refused (`write` returns False): the caller keeps those rows
another way for the step (eager capture), counts and logs it.
"""

import torch

from ..tensor import NVFP4Tensor

ROUTING = "routing"


def _row_amax(q: NVFP4Tensor) -> torch.Tensor:
    amax = q.global_amax.to(torch.float32)
    lead = q.codes.shape[:-1]
    return amax.reshape(1).expand(lead) if amax.numel() == 1 else amax.reshape(lead)


class StepBuffers:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capture buffer capacity must be >= 1 rows, got {capacity}")
        self.capacity = int(capacity)
        self.tensors: dict[tuple, tuple[torch.Tensor, ...]] = {}  # key -> (codes, scales, amax) or (ids,)
        self.stamps: dict[tuple, torch.Tensor] = {}  # key -> int64 [2]: (step, rows written)
        self._step: torch.Tensor | None = None  # int64 [1] on the buffers' device: the step being run
        self._step_value = 0
        self._staging: dict[tuple, tuple[torch.Tensor, ...]] = {}  # pinned host mirrors (CUDA only)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.tensors.values() for t in ts)

    def _alloc(self, key, parts, device) -> tuple[torch.Tensor, ...]:
        bufs = self.tensors.get(key)
        if bufs is None:
            bufs = tuple(torch.zeros((self.capacity, *p.shape[1:]), dtype=p.dtype, device=device) for p in parts)
            self.tensors[key] = bufs
            self.stamps[key] = torch.full((2,), -1, dtype=torch.int64, device=device)
            if self._step is None:
                self._step = torch.full((1,), self._step_value, dtype=torch.int64, device=device)
        return bufs

    def _stamp(self, key, rows: int) -> None:
        stamp = self.stamps[key]
        stamp[:1].copy_(self._step.to(stamp.device))
        stamp[1:].fill_(rows)

    def write_site(self, layer: int, site: str, q: NVFP4Tensor) -> bool:
        """Rows [0, T) of (layer, site) <- q (codes, scales, per-row amax); False if T > capacity."""
        T = q.codes.shape[0]
        if T > self.capacity:
            return False
        amax = _row_amax(q)
        key = (layer, site)
        codes, scales, amaxes = self._alloc(key, (q.codes, q.scales, amax), q.codes.device)
        codes[:T].copy_(q.codes)
        scales[:T].copy_(q.scales)
        amaxes[:T].copy_(amax)
        self._stamp(key, T)
        return True

    def write_routing(self, layer: int, topk_ids: torch.Tensor) -> bool:
        """Rows [0, T) of the layer's routed expert ids (stored int16); False if T > capacity."""
        T = topk_ids.shape[0]
        if T > self.capacity:
            return False
        key = (ROUTING, layer)
        (ids,) = self._alloc(key, (topk_ids[:0].to(torch.int16),), topk_ids.device)
        ids[:T].copy_(topk_ids)
        self._stamp(key, T)
        return True

    def write_tensor(self, key: tuple, t: torch.Tensor) -> bool:
        """Rows [0, T) of a plain tensor key (e.g. the KV slots a write went to); False if T > capacity."""
        T = t.shape[0]
        if T > self.capacity:
            return False
        (buf,) = self._alloc(key, (t[:0],), t.device)
        buf[:T].copy_(t)
        self._stamp(key, T)
        return True

    # ---- outside the forward -----------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Before the forward of step `step`: the stamps its writes will carry."""
        self._step_value = step
        if self._step is not None:
            self._step.fill_(step)

    def missing(self, step: int, keys, rows: int) -> list[tuple]:
        """Of `keys`, those the forward of `step` did not write (or wrote fewer than `rows` rows of)."""
        keys = list(keys)
        have = [k for k in keys if k in self.stamps]
        absent = [k for k in keys if k not in self.stamps]
        if not have:
            return absent
        stamps = torch.stack([self.stamps[k] for k in have]).cpu().tolist()  # one device-to-host copy
        return absent + [k for k, (s, n) in zip(have, stamps) if s != step or n < rows]

    def written_keys(self) -> list[tuple]:
        return list(self.tensors)

    def read(self, keys, start: int, stop: int) -> dict:
        """Host copies of rows [start, stop) of each key: NVFP4Tensor for a site, int16 ids for routing."""
        keys = list(keys)
        host = {}
        cuda = False
        for key in keys:
            parts = self.tensors[key]
            if parts[0].is_cuda:
                cuda = True
                staging = self._staging.get(key)
                if staging is None:
                    staging = self._staging[key] = tuple(
                        torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts
                    )
                for s, p in zip(staging, parts):
                    s[: stop - start].copy_(p[start:stop], non_blocking=True)
                host[key] = tuple(s[: stop - start] for s in staging)
            else:
                host[key] = tuple(p[start:stop] for p in parts)
        if cuda:
            torch.cuda.current_stream().synchronize()
        # Copies: the records keep these rows, the buffers are overwritten by the next step.
        out = {}
        for key, parts in host.items():
            parts = tuple(p.clone() for p in parts)
            out[key] = parts[0] if len(parts) == 1 else NVFP4Tensor(*parts)
        return out
