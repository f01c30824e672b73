"""A group's shared prompt rows, stored once (docs/architecture.md, "Shared prefixes").

The rows of a prompt are the same in every sample of a GRPO group (per-row amax is batch invariant,
and with prefix caching the samples literally share the prompt's computation). A record whose
identity names its prompt length P is stored as two blobs:

  prompt part   safetensors of every tensor's rows [0, S), S = P rounded down to a multiple of
                ALIGN_ROWS; its key is the SHA-256 of its bytes, so two records share it only if those
                rows are byte-identical (never by assumption)
  rest          safetensors of rows [S, T), carrying the whole record's metadata (checksums of the
                full tensors) plus the prompt part's key

Why rounded down: with prefix caching a later sample of the group gets a cache hit of whole KV blocks
and recomputes the prompt's last partial block itself; those few rows can differ in the last bits
from the first sample's (another batch), and would make the whole part unshareable. 128 rows is a
multiple of every vLLM / SGLang KV block size in use (16, 32, 64, 128).

`join` concatenates them and parses the result as a record (`GuidanceRecord.from_bytes`, every
checksum verified), so a record read from a store is byte-identical to the inline one.
Only token-major encodings are split (every tensor's first dimension is the token); a record with any
other encoding is stored whole.
"""

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..records import GuidanceRecord, RecordError, _canonical_header

TOKEN_MAJOR_ENCODINGS = ("full", "compact", None)
PREFIX_FORMAT = "trace-fp4-prompt-part"
PREFIX_KEY = "trace_fp4_prompt_part"  # metadata key of the rest blob naming its prompt part
PREFIX_ROWS = "trace_fp4_prompt_rows"
ALIGN_ROWS = 128


def split(record: GuidanceRecord):
    """(prompt key, prompt bytes, rest bytes), or None when the record is not split."""
    P = record.identity.num_prompt_tokens
    T = record.num_tokens
    P = (P or 0) // ALIGN_ROWS * ALIGN_ROWS
    if not P or P >= T or any(m not in TOKEN_MAJOR_ENCODINGS for m in record.modes):
        return None
    tensors = {k: v.detach().cpu().contiguous() for k, v in record.tensors.items()}
    if any(t.dim() == 0 or t.shape[0] != T for t in tensors.values()):
        return None
    # Canonical headers: equal prompt rows must give equal bytes (the key is their digest).
    head = _canonical_header(st_save({k: t[:P].contiguous() for k, t in tensors.items()},
                                     metadata={"format": PREFIX_FORMAT, "rows": str(P)}))
    key = "prompt-" + hashlib.sha256(head).hexdigest()
    meta = record._metadata()
    meta[PREFIX_KEY] = key
    meta[PREFIX_ROWS] = str(P)
    rest = _canonical_header(st_save({k: t[P:].contiguous() for k, t in tensors.items()}, metadata=meta))
    return key, head, rest


def _metadata(data: bytes) -> dict:
    if len(data) < 8:
        return {}
    (n,) = struct.unpack("<Q", data[:8])
    try:
        return json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except ValueError:
        return {}


def reference(data: bytes, source: str) -> str | None:
    """The prompt-part key a stored blob refers to, or None for a whole record."""
    return _metadata(data).get(PREFIX_KEY)


def join(rest: bytes, head: bytes, source: str) -> GuidanceRecord:
    meta = _metadata(rest)
    key = meta.pop(PREFIX_KEY)
    if "prompt-" + hashlib.sha256(head).hexdigest() != key:
        raise RecordError(f"{source}: its prompt part {key} is damaged (digest differs)")
    P = int(meta.pop(PREFIX_ROWS))
    try:
        a, b = st_load(head), st_load(rest)
    except Exception as e:
        raise RecordError(f"{source}: damaged stored record ({e})") from e
    if set(a) != set(b) or any(t.shape[0] != P for t in a.values()):
        raise RecordError(f"{source}: prompt part {key} does not fit the record (tensors or {P} rows differ)")
    full = {k: torch.cat([a[k], b[k]]) for k in b}
    return GuidanceRecord.from_bytes(st_save(full, metadata=meta), source=source)
