"""Rows for prefix-cache hits: a hit skips the forward of the cached tokens, so its rows come from here.

Every request's prompt rows are kept under the digest of its prompt's first k * block_size tokens (the
only places a hit can end), up to `max_bytes` (TRACE_FP4_PREFIX_ROWS_MAX_BYTES; oldest out first,
counted). The rows served are exactly the ones the engine used: the cached KV blocks hold the earlier
request's codes. A prompt not registered yet (its request is still in its chunked prefill) is served
from a running capture that already holds those rows.
"""

import hashlib
from collections import OrderedDict

import numpy as np

from .captured_rows import RequestCapture, chunk_nbytes, concat_chunks, copy_rows


def _prefix_digest(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


class PrefixRowsCache:
    def __init__(self, counters, max_bytes: int, block_size: int = 16):
        self.counters = counters
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._index: dict[str, tuple[int, int]] = {}  # prefix digest -> (entry id, rows)
        self._entries: OrderedDict[int, tuple[int, dict, dict, list[str]]] = OrderedDict()
        self.nbytes = 0
        self._next_entry = 0

    def register(self, cap: RequestCapture, prompt_ids) -> None:
        """Keep the prompt rows of `cap` (which holds at least the whole prompt)."""
        P = len(prompt_ids)
        B = self.block_size
        if P < B:
            cap.prompt_registered = True
            return
        sites, routing = concat_chunks(cap.chunks, P)
        nbytes = chunk_nbytes(sites, routing)
        if nbytes > self.max_bytes:
            self.counters["prefix_rows_too_large"] += 1
            cap.prompt_registered = True
            return
        # Incremental digests: the digest after k blocks is the hash of the first k * B ids.
        h = hashlib.sha256()
        ids = np.asarray(prompt_ids, dtype="<i8")
        keys = []
        for k in range(B, P + 1, B):
            h.update(ids[k - B : k].tobytes())
            keys.append((h.copy().hexdigest(), k))
        entry = self._next_entry
        self._next_entry += 1
        self._entries[entry] = (nbytes, sites, routing, [d for d, _ in keys])
        for d, k in keys:
            self._index[d] = (entry, k)
        self.nbytes += nbytes
        self.counters["prefix_prompts_cached"] += 1
        cap.prompt_registered = True
        while self.nbytes > self.max_bytes and len(self._entries) > 1:
            evicted, (nb, _, _, digests) = self._entries.popitem(last=False)
            for d in digests:
                if self._index.get(d, (None,))[0] == evicted:
                    self._index.pop(d, None)
            self.nbytes -= nb
            self.counters["prefix_prompts_evicted"] += 1

    def serve(self, cap: RequestCapture, prompt_ids, start: int, running) -> bool:
        """Append the first `start` prompt rows to `cap` (a hit of `start` tokens); False if none hold
        them. `running`: the captures in flight, which may hold rows not registered yet."""
        if start > len(prompt_ids):
            return False
        hit = self._index.get(_prefix_digest(prompt_ids[:start]))
        if hit is not None and hit[1] == start and hit[0] in self._entries:
            _, sites, routing, _ = self._entries[hit[0]]
            self._entries.move_to_end(hit[0])
        else:
            donor = next((c for c in running
                          if c is not cap and c.error is None and c.prompt_ids is not None and c.num_rows >= start
                          and len(c.prompt_ids) >= start and list(c.prompt_ids[:start]) == list(prompt_ids[:start])), None)
            if donor is None:
                return False
            sites, routing = concat_chunks(donor.chunks, start)
            self.counters["prefix_hits_served_from_running"] += 1
        cap.append(start, {k: copy_rows(q, 0, start) for k, q in sites.items()},
                   {k: t[:start].clone() for k, t in routing.items()})
        self.counters["prefix_hit_rows_served"] += start
        self.counters["prefix_hits_served"] += 1
        return True
