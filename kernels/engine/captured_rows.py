"""One request's captured rows, appended chunk by chunk, and the row helpers the capture needs.

A chunk is what one forward step computed for the request: (num_rows, {(layer, site): NVFP4Tensor
rows}, {layer: routed expert ids [n, top_k] int16}). Site tensors carry a per-row amax (a scalar amax
is expanded), so rows can be cut and joined freely.
"""

from dataclasses import dataclass, field

import torch

from ..tensor import NVFP4Tensor


def site_nbytes(q: NVFP4Tensor) -> int:
    return q.codes.numel() + q.scales.numel() + 4 * q.global_amax.numel()


def chunk_nbytes(sites: dict, routing: dict) -> int:
    return sum(site_nbytes(q) for q in sites.values()) + sum(t.numel() * t.element_size() for t in routing.values())


def _row_amax(q: NVFP4Tensor) -> torch.Tensor:
    amax = q.global_amax
    return amax.reshape(1).expand(q.codes.shape[:-1]) if amax.numel() == 1 else amax


def copy_rows(q: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    """Rows [start, stop), copied so the batch's storage can be freed."""
    amax = _row_amax(q)
    return NVFP4Tensor(q.codes[start:stop].clone(), q.scales[start:stop].clone(), amax[start:stop].clone())


def split_rows(q: NVFP4Tensor, start: int, sizes: list[int]) -> list[NVFP4Tensor]:
    """Per-request row views of a step tensor whose request rows start at `start`."""
    stop = start + sum(sizes)
    parts = (t[start:stop].split(sizes) for t in (q.codes, q.scales, _row_amax(q)))
    return [NVFP4Tensor(c, s, a) for c, s, a in zip(*parts)]


def to_host(q: NVFP4Tensor) -> NVFP4Tensor:
    # One device-to-host copy per site and step (seam: pinned buffers + a side stream on GPU).
    return NVFP4Tensor(q.codes.to("cpu"), q.scales.to("cpu"), q.global_amax.to("cpu"))


def concat_chunks(chunks, rows: int) -> tuple[dict, dict]:
    """The first `rows` rows of a capture's chunks as one (sites, routing) pair (copies)."""
    sites: dict = {}
    routing: dict = {}
    for _, s, r in chunks:
        for k, q in s.items():
            sites.setdefault(k, []).append(q)
        for k, t in r.items():
            routing.setdefault(k, []).append(t)
    cat = {}
    for k, parts in sites.items():
        amax = [_row_amax(p) for p in parts]
        cat[k] = NVFP4Tensor(torch.cat([p.codes for p in parts])[:rows].clone(),
                             torch.cat([p.scales for p in parts])[:rows].clone(), torch.cat(amax)[:rows].clone())
    return cat, {k: torch.cat(parts)[:rows].clone() for k, parts in routing.items()}


@dataclass
class RequestCapture:
    chunks: list[tuple[int, dict, dict]] = field(default_factory=list)  # (num_rows, sites, routing)
    num_rows: int = 0
    nbytes: int = 0
    error: str | None = None  # set when the capture cannot be a complete record
    weights: tuple = (None, None)  # (weights version, expert-weights digest) at the first captured rows
    # A weight update while the request ran (its rows from then on made by the new weights): the first
    # row and weights of each later version, in row order. The record says which version made which rows.
    weight_changes: list = field(default_factory=list)
    prompt_registered: bool = False  # its prompt rows are in the prefix-rows cache
    prompt_ids: list | None = None  # its prompt token ids (when serving prefix-cache hits)

    def append(self, num_rows: int, sites: dict, routing: dict) -> None:
        self.chunks.append((num_rows, sites, routing))
        self.num_rows += num_rows
        self.nbytes += chunk_nbytes(sites, routing)

    def weights_at(self, row: int, weights: tuple) -> None:
        """Rows from `row` on are made by `weights` (a weight update since the request started)."""
        latest = self.weight_changes[-1][1] if self.weight_changes else self.weights
        if weights != latest:
            self.weight_changes.append((row, weights))

    def newest_weights(self) -> tuple:
        return self.weight_changes[-1][1] if self.weight_changes else self.weights

    def version_ranges(self) -> tuple | None:
        """((first row, weights version), ...) when more than one version made the rows, else None."""
        if not self.weight_changes:
            return None
        ranges = [(0, self.weights[0])] + [(row, w[0]) for row, w in self.weight_changes]
        merged = [r for i, r in enumerate(ranges) if i == 0 or r[1] != ranges[i - 1][1]]
        return tuple(merged) if len(merged) > 1 else None

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (a preempted request is recomputed from `rows` on)."""
        self.weight_changes = [(r, w) for r, w in self.weight_changes if r < rows]
        while self.num_rows > rows:
            n, sites, routing = self.chunks[-1]
            keep = n - (self.num_rows - rows)
            if keep <= 0:
                self.chunks.pop()
                self.num_rows -= n
                self.nbytes -= chunk_nbytes(sites, routing)
                continue
            sites = {k: copy_rows(q, 0, keep) for k, q in sites.items()}
            routing = {k: t[:keep].clone() for k, t in routing.items()}
            self.chunks[-1] = (keep, sites, routing)
            self.num_rows = rows
            self.nbytes = sum(chunk_nbytes(s, r) for _, s, r in self.chunks)

    def record_chunks(self):
        """The chunks as `assemble_record` takes them: (routing, sites) in token order."""
        return [(routing, sites) for _, sites, routing in self.chunks]
