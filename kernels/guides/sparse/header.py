"""The int64 row header of a sparse guide in memory: what one row's payload needs besides its syndromes.

  bits  0-31  the amax coset index (low `amax_bits` of the amax key), or, static, the amax's float32 bits
  bits 32-36  shift: 16 when every amax is a bf16 value (the key counts bf16 ulps), else 0
  bits 37-52  the rates (amax_bits, scale_bits, code_bits), bit 52 static, bit 53 check-only,
              bit 54 4over6 choice bits present
"""

import numpy as np
import torch

from ...errors import SparseError
from ...format import BLOCK_SIZE
from .rates import Rates, segment


def amax_key(amax: torch.Tensor, shift: int) -> torch.Tensor:
    return (amax.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF) >> shift


def make_header(low: torch.Tensor, shift: int, rates: Rates, static: bool) -> torch.Tensor:
    return (low | (shift << 32) | (rates.amax_bits << 37) | (rates.scale_bits << 41) | (rates.code_bits << 45)
            | (int(static) << 52) | (int(rates.check) << 53) | (int(rates.choice) << 54))


def parse_header(word: int):
    """(shift, Rates, static) of one row header word."""
    rates = Rates((word >> 37) & 0xF, (word >> 41) & 0xF, (word >> 45) & 0x7F, bool((word >> 53) & 1),
                  bool((word >> 54) & 1))
    return (word >> 32) & 0x1F, rates, bool((word >> 52) & 1)


def check_header(header: torch.Tensor, K: int):
    """(shift, Rates, static) shared by every row; SparseError if the rows disagree or do not fit K."""
    h = header.numpy() if header.device.type == "cpu" else header  # numpy: a few us per op, not torch's tens
    first = int(h[0])
    shift, rates, static = parse_header(first)
    same = bool(((h >> 32) == (first >> 32)).all()) and (not static or bool((h == first).all()))
    bps = segment(K) // BLOCK_SIZE
    if shift not in (0, 16) or not same or rates.scale_bits > bps or (static and rates.amax_bits):
        raise SparseError(f"sparse guide rows of K={K}: inconsistent row headers (shift {shift}, {rates}, "
                          f"static {static}, uniform {same})")
    return shift, rates, static


# (row header >> 32, K) -> check_header's (shift, Rates, static): everything check_header validates lies in
# those bits and K, so a header word seen once needs no second parse (a trainer step decodes 16 sites of
# the same few headers; the parse and its checks were ~6 us a call).
_CHECKED: dict = {}


def uniform_header(header: torch.Tensor, K: int):
    """check_header(header, K) where every row can be decoded in one call (header_groups would return None),
    else None (the caller then splits the rows with header_groups). One pass over the rows for both
    questions: the rows form one group iff their bits 32 and up agree (shift, rates, static and check
    flags) and, static, their amax bits too; check_header's `same` is that same condition, so a uniform
    header only needs its first word checked, once (raises check_header's SparseError where that fails)."""
    h = header.numpy() if header.device.type == "cpu" else header.cpu().numpy()
    first = int(h[0])
    if not bool(((h >> 32) == (first >> 32)).all()) or ((first >> 52) & 1 and not bool((h == first).all())):
        return None
    key = (first >> 32, K)
    hit = _CHECKED.get(key)
    if hit is None:
        hit = _CHECKED[key] = check_header(header, K)
    return hit


def header_groups(header: torch.Tensor) -> list[torch.Tensor] | None:
    """Row indices of each group of rows that one decode call can take (the same shift, rates and static
    flag; static rows also the same amax), or None when all rows form one group (the common case).

    Rows of several records meet in one decode (a trainer layer's site concatenates every record's rows),
    and records may differ in their headers: a controller changed the rates between weight syncs, or a
    record's site had one amax for all its rows (a 1-token sample's moe_fc1_in: both experts see the same
    token) and was sent static. Each group decodes alone; a row's decode depends on its own row only."""
    h = header.numpy() if header.device.type == "cpu" else header.cpu().numpy()
    if h.size == 0:
        return None
    static = ((h >> 52) & 1).astype(bool)
    key = np.where(static, h, (h >> 32) << 32)  # static keys keep bit 52, so they never equal a non-static one
    if bool((key == key[0]).all()):
        return None
    _, inverse = np.unique(key, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    return [torch.from_numpy(part).to(header.device) for part in np.split(order, bounds)]
