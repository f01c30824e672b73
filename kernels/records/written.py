"""Record bytes this process wrote for a reader in this same process, kept with what the writer knew.

Why: with vLLM's engine in the driver's process (`LLM` with VLLM_ENABLE_V1_MULTIPROCESSING=0, what the
CPU benches run), the worker writes each record's bytes and the driver reads the very same `bytes`
object back (`GuidanceRecord.from_bytes`): parsing the header JSON back, hashing the metadata again and
parsing its shape / config / identity texts cost ~0.1 ms a record, for what the writer held as objects
a moment before. The writer `keep`s, next to the bytes, its record's metadata objects, its checksums
and where each tensor lies; `from_bytes` of that same object (`take`, an identity test: not equal bytes,
the object itself, which nobody can change) builds the record from them. Each tensor is copied out of
the bytes (its own storage), and `integrity.verify_layout` checks the tensor names, shapes and dtypes
against the layout (a refusal names the tensor as `verify` does); it reads no checksum. Every record
read this way is counted in `READ_BACK["same_process"]`.

The trust rule (lane take9; lane bytes10: the body): such a read does not hash the tensors again, nor
compare the checksums (`verify` compared the kept checksums with themselves). The writer joined the
tensors into one immutable body, hashed each tensor where it lies in that body, and copied that body
behind the header into this `bytes` object (safetensors_bytes.record_body / with_header), which is
immutable and never left the process: hashing it again could only find a bug in the writer's join
(tested byte for byte against safetensors' own writer), never damage, and cost ~0.08 ms a record.
Anything else is hashed and compared
with the checksums in its header as always (`verify`): bytes that crossed a process (a multiprocessing
engine, AsyncLLM, a Ray worker), a store or a file, a copy with equal bytes, a second read of the same
object (its entry is dropped at the first), a take's bytes after the next take began.

Only the worker's take keeps bytes, and only when the driver that asked runs in this process (it
sends its pid); the entries are the latest take's (cleared when a take starts), and `take` drops each
as it is read, so nothing outlives the reply the driver holds anyway.
"""

import threading
from collections import Counter

READ_BACK: Counter = Counter()  # "same_process": records read back from what this process kept

_KEPT: dict = {}  # id(bytes) -> (the bytes, Kept)
_LOCK = threading.Lock()


class Kept:
    """What the writer knew of one record's bytes: its record's shape, config, token count, modes and
    identity (frozen objects, shared as a take's records share them), the checksums it wrote into the
    metadata, the header's length and each tensor's place (safetensors_bytes.save_layout's entries)."""

    __slots__ = ("shape", "config", "num_tokens", "modes", "identity", "checksums", "header_len", "entries", "empties")

    def __init__(self, record, checksums: dict, header_len: int, entries: list, empties: dict | None = None):
        self.shape, self.config, self.num_tokens = record.shape, record.config, record.num_tokens
        self.modes, self.identity = record.modes, record.identity
        self.checksums, self.header_len, self.entries = checksums, header_len, entries
        # {(dtype name, shape): an empty tensor} shared by the records of one take written together
        # (take_bytes.write_take): their read-back gives each empty tensor once, as the take that built
        # them shares one empty audit per site; None: each empty tensor made anew (to_bytes)
        self.empties = empties


def keep(data: bytes, kept: Kept) -> None:
    with _LOCK:
        _KEPT[id(data)] = (data, kept)


def take(data) -> Kept | None:
    """What was kept with exactly this object (not another with equal bytes), dropped from the keep;
    None for anything else (a file, bytes that crossed a process, a take's bytes read twice)."""
    if type(data) is not bytes:
        return None
    with _LOCK:
        entry = _KEPT.get(id(data))
        if entry is None or entry[0] is not data:
            return None
        del _KEPT[id(data)]
    return entry[1]


def clear() -> None:
    """Drop every kept entry (a take starting: the previous take's bytes the driver did not read)."""
    with _LOCK:
        _KEPT.clear()
