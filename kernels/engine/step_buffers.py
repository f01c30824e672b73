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

Buffers a custom op declares. An op that writes capture buffers can name them as its operands (vLLM's
MoE op lists them in `mutates_args`, so torch.compile knows what it mutates): `allocate_moe_layer`
makes one MoE layer's buffers at model build, before anything is compiled, and returns them as the
op's operands; the op writes them with `write_rows`, the same copies and stamp as every other key.
"""

import torch

from ..tensor import NVFP4Tensor

ROUTING = "routing"

# Cached buffer slices (by row count) per StepBuffers and direction before the cache starts over.
_MAX_VIEWS = 1024


# The sites of a routed-expert layer, in the order of its capture operands (`allocate_moe_layer`).
MOE_SITES = ("moe_fc1_in", "moe_fc2_in")
# Rows of the stamp block of a routed-expert layer: one per key it writes.
MOE_STAMP_ROWS = (ROUTING,) + MOE_SITES


def _row_amax(q: NVFP4Tensor) -> torch.Tensor:
    amax = q.global_amax
    if amax.dtype != torch.float32:
        amax = amax.to(torch.float32)
    lead = q.codes.shape[:-1]
    if amax.shape == lead:  # the usual per-row amax: no op at all (this runs per site and step)
        return amax
    return amax.reshape(1).expand(lead) if amax.numel() == 1 else amax.reshape(lead)


def site_parts(q: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a site's buffers hold of `q`: codes, E4M3 scales, one float32 amax per row."""
    return q.codes, q.scales, _row_amax(q)


def write_rows(bufs: tuple, stamp: torch.Tensor, step: torch.Tensor, parts: tuple, views: dict | None = None) -> bool:
    """Rows [0, T) of `bufs` <- `parts` (copies, converting dtype where the buffer differs) and
    `stamp` <- (step, T): device writes only, so a CUDA graph replays them. False (nothing written)
    when T exceeds the buffers' rows.

    `views`: a cache of the destination slices by (buffer, stamp, T) (a StepBuffers' own). Why: this
    runs for every captured key of every layer at every step; slicing three buffers and the stamp
    and copying each is a dozen dispatches (about 9 us on a CPU, 20 keys a step), where the cached
    slices and one `_foreach_copy_` are two (about 2 us). Same copies, same device writes."""
    T = parts[0].shape[0]
    if T > bufs[0].shape[0]:
        return False
    if step.device != stamp.device:
        step = step.to(stamp.device)
    key = (bufs[0].data_ptr(), stamp.data_ptr(), T)
    dst = views.get(key) if views is not None else None
    if dst is None:
        dst = ([buf[:T] for buf in bufs] + [stamp[:1]], stamp[1:])
        if views is not None:
            views[key] = dst
    torch._foreach_copy_(dst[0], [*parts, step])
    dst[1].fill_(T)
    return True


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
        # Slices of the buffers by rows written / read, made once (write_rows, read): a decode step
        # writes and reads the same row counts every time. Tied to this object (the slices keep
        # the buffers alive no longer than the buffers themselves live).
        self._write_views: dict = {}
        self._read_views: dict = {}
        # A key's destination slices by (key, T, the op's buffer address or 0): every put runs 1,024
        # times a 64-step generate of the tiny model, and once a key took T rows through write_rows
        # (shapes checked, buffers made), the next T-row write of the same shapes needs only its copies
        # and stamp (about 4 us of Python checks less per put). Site amaxes must keep the per-row shape
        # seen then; any other write goes through write_rows as before.
        self._fast_writes: dict = {}
        # (keys, start, stop) -> ((key, host buffer slices), ...) of a read of host buffers (see read);
        # dropped when a key's buffers are made (its slices would name the old ones).
        self._read_plans: dict = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.tensors.values() for t in ts)

    def _alloc(self, key, parts, device) -> tuple[torch.Tensor, ...]:
        bufs = self.tensors.get(key)
        if bufs is None:
            bufs = tuple(torch.zeros((self.capacity, *p.shape[1:]), dtype=p.dtype, device=device) for p in parts)
            self.tensors[key] = bufs
            self._read_plans.clear()
            self._fast_writes.clear()
            self.stamps[key] = torch.full((2,), -1, dtype=torch.int64, device=device)
            self._step_tensor(device)
        return bufs

    def _step_tensor(self, device) -> torch.Tensor:
        if self._step is None:
            self._step = torch.full((1,), self._step_value, dtype=torch.int64, device=device)
        return self._step

    def allocate_moe_layer(
        self, layer: int, hidden: int, intermediate: int, top_k: int, sites: bool, device
    ) -> tuple[torch.Tensor, ...]:
        """One routed-expert layer's buffers, made now (at model build): the routed ids and, when
        `sites`, moe_fc1_in ([T, hidden] rows) and moe_fc2_in ([T, top_k, intermediate] rows).
        Returns the operands of the op that writes them, in this order: ids, fc1 codes, scales,
        amax, fc2 codes, scales, amax, the layer's stamp block (one row per key, MOE_STAMP_ROWS),
        the step counter (read only). A site not captured gets 0-row placeholders (never written)."""
        from ..format import BLOCK_SIZE

        n = self.capacity
        u8, f32 = torch.uint8, torch.float32
        step = self._step_tensor(device)
        stamps = torch.full((len(MOE_STAMP_ROWS), 2), -1, dtype=torch.int64, device=device)
        ids = torch.zeros((n, top_k), dtype=torch.int16, device=device)
        self._read_plans.clear()
        self._fast_writes.clear()
        self.tensors[(ROUTING, layer)] = (ids,)
        self.stamps[(ROUTING, layer)] = stamps[0]
        operands = [ids]
        for i, (site, lead) in enumerate(((MOE_SITES[0], (n,)), (MOE_SITES[1], (n, top_k))), start=1):
            width = hidden if i == 1 else intermediate
            if sites:
                bufs = (torch.zeros((*lead, width // 2), dtype=u8, device=device),
                        torch.zeros((*lead, width // BLOCK_SIZE), dtype=u8, device=device),
                        torch.zeros(lead, dtype=f32, device=device))
                self.tensors[(layer, site)] = bufs
                self.stamps[(layer, site)] = stamps[i]
            else:  # distinct tensors: an op's mutable operands may not alias each other
                bufs = tuple(torch.empty(0, dtype=dt, device=device) for dt in (u8, u8, f32))
            operands.extend(bufs)
        return (*operands, stamps, step)

    def write_site(self, layer: int, site: str, q: NVFP4Tensor, into=None) -> bool:
        """Rows [0, T) of (layer, site) <- q (codes, scales, per-row amax); False if T > capacity.
        `into` = (buffers, stamp, step): an op's own operands (see `allocate_moe_layer`)."""
        codes = q.codes
        fast = self._fast_writes.get((layer, site, codes.shape[0], None if into is None else into[0][0].data_ptr()))
        if fast is not None and q.global_amax.shape == fast[2]:
            # The same copies and stamp as write_rows below, made without its checks (see _fast_writes).
            torch._foreach_copy_(fast[0], [codes, q.scales, q.global_amax, fast[3]])
            fast[1].fill_(codes.shape[0])
            return True
        parts = site_parts(q)
        given = into is not None
        if into is None:
            if parts[0].shape[0] > self.capacity:
                return False
            key = (layer, site)
            into = (self._alloc(key, parts, q.codes.device), self.stamps[key], self._step)
        if not write_rows(*into, parts, views=self._write_views):
            return False
        if q.global_amax.shape == parts[0].shape[:-1] and q.global_amax.dtype == torch.float32:
            self._remember(layer, site, codes.shape[0], into, given, q.global_amax.shape)
        return True

    def write_routing(self, layer: int, topk_ids: torch.Tensor, into=None) -> bool:
        """Rows [0, T) of the layer's routed expert ids (stored int16); False if T > capacity."""
        fast = self._fast_writes.get((ROUTING, layer, topk_ids.shape[0], None if into is None else into[0][0].data_ptr()))
        if fast is not None:
            torch._foreach_copy_(fast[0], [topk_ids, fast[3]])
            fast[1].fill_(topk_ids.shape[0])
            return True
        given = into is not None
        if into is None:
            if topk_ids.shape[0] > self.capacity:
                return False
            key = (ROUTING, layer)
            into = (self._alloc(key, (topk_ids[:0].to(torch.int16),), topk_ids.device), self.stamps[key], self._step)
        if not write_rows(*into, (topk_ids,), views=self._write_views):
            return False
        self._remember(ROUTING, layer, topk_ids.shape[0], into, given, None)
        return True

    def _remember(self, a, b, T: int, into, given: bool, amax_shape) -> None:
        """After a write of T rows to key (a, b) went through write_rows: keep its destination slices
        for the next write of T rows there (`_fast_writes`); `given`: the caller named the buffers (an op's
        operands), keyed by their address as the caller's next lookup is."""
        bufs, stamp, step = into
        if step.device != stamp.device:
            return  # write_rows moves the step counter each time: no fast path for that rare layout
        if len(self._fast_writes) > _MAX_VIEWS:
            self._fast_writes.clear()
        dst = [buf[:T] for buf in bufs] + [stamp[:1]]
        self._fast_writes[(a, b, T, bufs[0].data_ptr() if given else None)] = (dst, stamp[1:], amax_shape, step)

    def write_tensor(self, key: tuple, t: torch.Tensor) -> bool:
        """Rows [0, T) of a plain tensor key (e.g. the KV slots a write went to); False if T > capacity."""
        if t.shape[0] > self.capacity:
            return False
        bufs = self._alloc(key, (t[:0],), t.device)
        return write_rows(bufs, self.stamps[key], self._step, (t,), views=self._write_views)

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
        plan_key = (tuple(keys), start, stop)
        plan = self._read_plans.get(plan_key)
        if plan is not None:
            # Host buffers read before with these keys and rows: the same clones, without the loop's
            # per-key checks and cache lookups below (20 keys a step on the native CPU engine).
            return {key: parts[0].clone() if len(parts) == 1 else NVFP4Tensor(parts[0].clone(), parts[1].clone(), parts[2].clone())
                    for key, parts in plan}
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
                view_key = (key, parts[0].data_ptr(), start, stop)
                rows = self._read_views.get(view_key)
                if rows is None:
                    if len(self._read_views) > _MAX_VIEWS:
                        self._read_views.clear()
                    rows = self._read_views[view_key] = tuple(p[start:stop] for p in parts)
                host[key] = rows
        if cuda:
            torch.cuda.current_stream().synchronize()
        else:  # every key on the host: the next read of these keys and rows takes the plan above
            if len(self._read_plans) > _MAX_VIEWS:
                self._read_plans.clear()
                self._fast_writes.clear()
            self._read_plans[plan_key] = tuple(host.items())
        # Copies: the records keep these rows, the buffers are overwritten by the next step.
        out = {}
        for key, parts in host.items():
            if len(parts) == 1:
                out[key] = parts[0].clone()
            else:
                out[key] = NVFP4Tensor(parts[0].clone(), parts[1].clone(), parts[2].clone())
        return out
