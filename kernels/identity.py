"""What a guidance record belongs to: its sample, and the policy (weights) that made it.

A record's rows are only right for the tokens that produced them, run by the weights that produced
them. `RecordIdentity` travels inside the record's (checksummed) metadata:

  token_digest      sha256 of the token ids whose rows the record holds (prompt + generated, without
                    the last sampled token), as int64 little-endian: `token_digest(ids)`
  num_tokens        how many ids that digest covers (= the record's token rows)
  num_prompt_tokens how many of them are the prompt (lets a store keep a group's prompt rows once)
  weights_version   the rollout engine's weights version (a counter bumped at every weight update,
                    or what the RL driver set); int or str
  weights_digest    sha256 over the NVFP4 expert weights the engine ran (`weights_digest(...)`)
  version_ranges    a partial rollout (aborted at a weight update, resumed under the new weights):
                    ((first row, weights version), ...) in row order, each range running to the next
                    one's first row; weights_version / weights_digest are then the newest range's.
                    None (absent from the metadata) when one version made every row.

`check_identity` is the trainer-side comparison; it raises `RecordError` naming the sample and field.
"""

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from .errors import RecordError


@dataclass(frozen=True)
class RecordIdentity:
    token_digest: str | None = None
    num_tokens: int | None = None
    weights_version: int | str | None = None
    weights_digest: str | None = None
    num_prompt_tokens: int | None = None
    version_ranges: tuple | None = None

    def __post_init__(self):
        if self.version_ranges is not None:
            ranges = tuple((int(start), version) for start, version in self.version_ranges)
            starts = [s for s, _ in ranges]
            if not ranges or starts[0] != 0 or starts != sorted(set(starts)):
                raise ValueError(f"version_ranges must start at row 0 with increasing first rows, got {list(ranges)}")
            if self.num_tokens is not None and starts[-1] >= self.num_tokens:
                raise ValueError(f"version_ranges: a range starts at row {starts[-1]}, the record has {self.num_tokens} rows")
            object.__setattr__(self, "version_ranges", ranges)

    def to_dict(self) -> dict:
        # the fields as they are where each is a str, int or None (what asdict's deep copy gives of them,
        # without its recursion: ~50 us a record, written into every record of a take)
        d = {f: getattr(self, f) for f in _FIELD_NAMES}
        if any(type(v) not in _PLAIN for k, v in d.items() if k != "version_ranges"):
            d = dataclasses.asdict(self)
        if d["version_ranges"] is None:  # records of one version keep their metadata (and bytes) as before
            del d["version_ranges"]
        else:
            d["version_ranges"] = [list(r) for r in self.version_ranges]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RecordIdentity":
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown identity fields {unknown}")
        return cls(**d)

    def row_versions(self, num_rows: int | None = None) -> list[tuple[int, int, object]]:
        """[(first row, end row, weights version)] covering the record's rows: one range unless the
        record is a partial rollout's."""
        T = self.num_tokens if num_rows is None else num_rows
        if self.version_ranges is None:
            return [(0, T, self.weights_version)]
        starts = [s for s, _ in self.version_ranges] + [T]
        return [(a, b, v) for (a, v), b in zip(self.version_ranges, starts[1:])]


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RecordIdentity))
_PLAIN = (str, int, float, bool, type(None))  # values asdict returns as they are


def _ids_array(token_ids) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError(f"token ids must be a 1-D integer tensor, got {token_ids.dtype}{list(token_ids.shape)}")
        return token_ids.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=False)
    arr = np.asarray(list(token_ids), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence of ints")
    return arr.astype("<i8", copy=False)


def token_digest(token_ids) -> str:
    """sha256 (hex) of `token_ids` as int64 little-endian bytes (list, tuple, numpy or 1-D tensor)."""
    return hashlib.sha256(_ids_array(token_ids).tobytes()).hexdigest()


def describe(record, source: str) -> str:
    """`source` plus the file or handle the record was read from, if any."""
    origin = getattr(record, "origin", None)
    return f"{source} ({origin})" if origin and origin != "record" else source


def num_ids(token_ids) -> int:
    return int(token_ids.numel()) if isinstance(token_ids, torch.Tensor) else len(token_ids)


def _older(have, want) -> bool | None:
    """Whether version `have` is older than `want`; None where the two cannot be ordered (strings)."""
    if isinstance(have, int) and isinstance(want, int) and not isinstance(have, bool):
        return have < want
    return None


def check_identity(record, *, source: str, token_ids=None, weights_version=None, weights_digest=None,
                   accept_stale: bool = False) -> str | None:
    """Raise RecordError unless `record` belongs to `token_ids` and the expected weights.

    `token_ids`: the tokens the trainer runs for this sample; the record covers the first
    `record.num_tokens` of them (the trainer may also run the last sampled token, which never entered
    the rollout model, so len(token_ids) may be num_tokens or num_tokens + 1).
    Returns "stale" when the record comes from an older weights version and `accept_stale` (the
    caller counts it), else None.
    """

    source = describe(record, source)
    ident = record.identity
    T = record.num_tokens
    if token_ids is not None:
        n = num_ids(token_ids)
        if n not in (T, T + 1):
            raise RecordError(
                f"{source}: length differs: the record holds {T} token rows, the trainer runs {n} tokens "
                f"(expected {T} or {T + 1} with the last sampled token)"
            )
        if ident.token_digest is None:
            raise RecordError(f"{source}: tokens cannot be checked: the record carries no token digest (made without token ids)")
        mine = token_digest(token_ids[:T])
        if mine != ident.token_digest:
            raise RecordError(
                f"{source}: tokens differ: the record was made for other token ids (digest "
                f"{ident.token_digest[:12]}..., the trainer's first {T} tokens give {mine[:12]}...): a record of another sample?"
            )
    stale = False
    if weights_version is not None:
        have = ident.weights_version
        if have is None:
            raise RecordError(f"{source}: weights cannot be checked: the record carries no weights version")
        # A partial rollout: rows made by older weights than its newest are as stale as a whole record.
        for a, b, v in ident.row_versions(T)[:-1]:
            if v != weights_version and _older(v, weights_version) is not False and not accept_stale:
                raise RecordError(
                    f"{source}: weights differ: rows {a}..{b - 1} of the record (a partial rollout) were made with "
                    f"weights version {v!r}, the trainer expects {weights_version!r} (pass accept_stale=True to "
                    "train off-policy; it is counted)"
                )
            stale = stale or v != weights_version
        if have != weights_version:
            older = _older(have, weights_version)
            if older is False:
                raise RecordError(
                    f"{source}: weights differ: the record's weights version {have!r} is newer than the expected {weights_version!r}"
                )
            if not accept_stale:
                raise RecordError(
                    f"{source}: weights differ: the record was made with weights version {have!r}, the trainer "
                    f"expects {weights_version!r} (pass accept_stale=True to train off-policy; it is counted)"
                )
            stale = True
    if weights_digest is not None and ident.weights_digest != weights_digest:
        if ident.weights_digest is None:
            raise RecordError(f"{source}: weights cannot be checked: the record carries no weights digest")
        if not stale:
            raise RecordError(
                f"{source}: weights differ: the record's expert-weights digest {ident.weights_digest[:12]}... is not "
                f"the expected {weights_digest[:12]}..."
                + ("" if weights_version is None else f" although both say weights version {weights_version!r}")
            )
    return "stale" if stale else None


def stale_rows(record, weights_version) -> int:
    """How many of the record's rows were made by weights older than `weights_version` (0 where the
    versions cannot be ordered, or the trainer names none)."""
    if weights_version is None:
        return 0
    return sum(b - a for a, b, v in record.identity.row_versions(record.num_tokens) if _older(v, weights_version))
