"""The audit of a sparse record: the full 4-bit codes of a small sample of its tokens' rows.

Sparse guidance leaves two kinds of residual: segments no searched pattern explains (the decoder counts
them) and segments it "resolves" with a wrong pattern that has the right syndrome, which it cannot
see. The audit makes the second kind measurable: the trainer compares what it decoded for the audited
tokens with their full codes, per layer and site, and the rate controller (controller.py) acts on that.

Rows: `fraction` of the record's token rows (dimension 0 of the site's rows; all KV heads / routed slots
of a chosen token), chosen by a seed derived from the record's identity (its token count, the token
digest when the engine knows it at build, the layer and the site). The count is floor(fraction * T + u)
with u in [0, 1) from the same seed, so its mean is fraction * T exactly. The chosen rows are stored with
the audit (int32 per audited token), so an identity field stamped after the build (e.g. the token
digest a rollout server adds) does not move them; every audit byte is part of the record's size. Only
the codes are sent (a codeword is sign and magnitude: what the residual counts); at 1% that is 0.04 bits
per value plus the row indices.
"""

import hashlib
import math
import random

import numpy as np
import torch

from ...errors import RecordError
from ...tensor import NVFP4Tensor

PARTS = ("audit",)  # one uint8 tensor per site: the rows (int32 each), then their packed codes


def audit_seed(num_tokens: int, layer: int, site: str, token_digest: str | None) -> int:
    text = f"trace-fp4 audit|{num_tokens}|{layer}|{site}|{token_digest or ''}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def audit_rows(num_tokens: int, layer: int, site: str, fraction: float, token_digest: str | None = None) -> torch.Tensor:
    """int64 [n], sorted: the audited token rows of a record of `num_tokens` rows."""
    return torch.tensor(audit_row_list(num_tokens, layer, site, fraction, token_digest), dtype=torch.int64)


def audit_row_list(num_tokens: int, layer: int, site: str, fraction: float, token_digest: str | None = None) -> list[int]:
    """`audit_rows` as a sorted list (the engine's take draws them for every site of every record: most
    are empty at the default fraction, and a torch tensor per site cost more than the draw)."""
    if fraction <= 0 or num_tokens == 0:
        return []
    return seeded_row_list(num_tokens, fraction, audit_seed(num_tokens, layer, site, token_digest))


def seeded_row_list(num_tokens: int, fraction: float, seed: int) -> list[int]:
    """`audit_row_list` from its `audit_seed` (the engine's take has every seed already: audit_draw)."""
    # Python's Mersenne Twister, seeded by the integer: deterministic across platforms and versions, and
    # a few microseconds (a torch generator costs more than the rest of a small site's encode)
    rng = random.Random(seed)
    n = min(num_tokens, math.floor(fraction * num_tokens + rng.random()))
    return sorted(rng.sample(range(num_tokens), n))


def audit_parts(full: NVFP4Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The record tensor of the audit: uint8 [n * 4 + n * row bytes], the token rows (int32, little
    endian) then the packed codes of `full[rows]` ([T, *row] NVFP4). One tensor, so the audit adds a
    single entry (name and checksum) to the file's header per site."""
    codes = full.codes
    if codes.device.type == "cpu" and rows.device.type == "cpu" and not codes.requires_grad:
        # the same bytes with numpy (the engine's take audits every site of every record: the torch
        # ops here were ~6 dispatches per site, a numpy take and one concatenation are ~3 us)
        return {"audit": audit_blob_numpy(rows.numpy(), codes.numpy())}
    return {"audit": audit_blob(rows, codes[rows])}


def audit_blob_numpy(rows: np.ndarray, codes: np.ndarray) -> torch.Tensor:
    """`audit_blob(rows, codes[rows])` with numpy: increasing int64 token rows [n] of host packed codes
    [T, ...] (audit_parts, and the engine's take, which audits every site of every record)."""
    blob = np.concatenate([rows.astype("<i4").view(np.uint8), codes[rows].reshape(-1)])
    # (an empty numpy array comes through as a stride-0 tensor, which the reader's int32 view refuses)
    return torch.from_numpy(blob) if blob.size else torch.empty(0, dtype=torch.uint8)


def audit_blob(rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The audit tensor from increasing token rows [n] and their packed codes [n, ...]."""
    idx = rows.to(torch.int32).contiguous().view(torch.uint8)
    return torch.cat([idx, codes.contiguous().reshape(-1)])


def from_parts(parts: dict[str, torch.Tensor], lead: tuple, K: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int64 [n], packed codes uint8 [n, *lead[1:], K // 2]) from the record tensor; RecordError
    names what does not fit rows `lead` x K."""
    blob = parts.get("audit")
    n, inner = _check_size(blob, lead, K, where)
    if blob.device.type == "cpu":
        # numpy for a host record (the same rows and the same check, from_parts_host)
        r, _ = from_parts_host(parts, lead, K, where)
        return torch.from_numpy(r), blob[4 * n :].reshape(n, *inner, K // 2)
    r = blob[: 4 * n].clone().view(torch.int32).to(torch.int64)
    _check_rows(r, n, lead[0], where)
    return r, blob[4 * n :].reshape(n, *inner, K // 2)


def from_parts_host(parts: dict[str, torch.Tensor], lead: tuple, K: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """`from_parts` of a host record as numpy arrays (rows int64 [n], packed codes uint8 [n, *lead[1:],
    K // 2], a view of the record's tensor), checked alike: a trainer's batch reads every (layer, site)'s
    audit of every record in the step (64 here) and builds its tables with numpy, where the torch
    tensors cost more than the rows (record_tables.py)."""
    blob = parts.get("audit")
    n, inner = _check_size(blob, lead, K, where)
    raw = blob.numpy()
    r = raw[: 4 * n].view(np.int32).astype(np.int64)
    _check_rows(r, n, lead[0], where)
    return r, raw[4 * n :].reshape(n, *inner, K // 2)


def _check_size(blob, lead: tuple, K: int, where: str) -> tuple[int, tuple]:
    """(audited rows n, the row shape's inner dims) of an audit tensor; RecordError unless it is uint8
    [n * (4 + row bytes)]."""
    inner = tuple(lead[1:])
    row_bytes = math.prod(inner) * K // 2
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() % (4 + row_bytes):
        raise RecordError(f"{where}: audit tensor is {getattr(blob, 'dtype', type(blob))}"
                          f"{list(getattr(blob, 'shape', []))}, expected uint8 [n * {4 + row_bytes}]")
    return blob.numel() // (4 + row_bytes), inner


def _check_rows(r, n: int, T: int, where: str) -> None:
    # increasing rows have their least first and their largest last: one comparison pass, not three
    if n and (not bool((r[1:] > r[:-1]).all()) or int(r[0]) < 0 or int(r[-1]) >= T):
        raise RecordError(f"{where}: audit rows must be increasing token rows in [0, {T}), got {r.tolist()[:8]}")
