"""A record's safetensors bytes written directly: what `canonical_header(safetensors.torch.save(...))`
writes, byte for byte, without safetensors' per-tensor checks and numpy round trips and without
parsing its header back to sort the metadata.

Why: a record is ~40 small tensors; safetensors' save costs about 0.5 ms per record of Python around
its Rust writer, then `canonical_header` parses and rewrites the header: together a fifth of what
taking a record costs in the engine. The format is simple: an 8-byte little-endian header length, a
JSON header ({"__metadata__": sorted metadata} then one entry per tensor), padded with spaces to 8
bytes, then the tensors' bytes in the header's order. safetensors orders the tensors by dtype (larger
alignment first, `_ORDER`) then by name; tests/kernels/test_records.py checks the bytes equal
safetensors' for every dtype here. A dtype not listed is written by safetensors itself.
"""

import hashlib
import json
import struct

import torch

# safetensors' name of each dtype and its rank in safetensors' file order (highest first), as
# safetensors 0.8's serializer sorts them (its Dtype enum order, descending).
_ORDER = {
    torch.int64: ("I64", 9), torch.float64: ("F64", 8), torch.float32: ("F32", 7), torch.int32: ("I32", 6),
    torch.bfloat16: ("BF16", 5), torch.float16: ("F16", 4), torch.int16: ("I16", 3), torch.int8: ("I8", 2),
    torch.uint8: ("U8", 1), torch.bool: ("BOOL", 0),
}


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order (little endian on every host torch runs on)."""
    if not t.numel():
        return b""
    if numpy_view(t):  # the usual record tensor: one numpy view, not five torch ops (36 per record)
        return t.numpy().tobytes()
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def numpy_view(t: torch.Tensor) -> bool:
    """Whether `t.numpy()` is its bytes as they are: a contiguous host tensor of a dtype numpy has."""
    return t.device.type == "cpu" and t.dtype != torch.bfloat16 and not t.requires_grad and t.is_contiguous()


def digest_of(t: torch.Tensor, raw: bytes) -> str:
    """integrity.tensor_digest(t), from its bytes already read."""
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(raw)
    return h.hexdigest()


def writable(tensors: dict) -> bool:
    return all(t.dtype in _ORDER for t in tensors.values())


def save_bytes(tensors: dict[str, torch.Tensor], raw: dict[str, bytes], metadata: dict[str, str]) -> bytes:
    """The safetensors file of `tensors` (dtypes of `_ORDER` only: see `writable`) whose bytes are
    `raw[name]`, with `metadata`, its header as integrity.canonical_header writes it."""
    order = sorted(tensors, key=lambda k: (-_ORDER[tensors[k].dtype][1], k))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name in order:
        t = tensors[name]
        n = len(raw[name])
        header[name] = {"dtype": _ORDER[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(raw[name] for name in order)])
