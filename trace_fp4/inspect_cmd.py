"""`trace-fp4 inspect RECORD_OR_HANDLE [--verify] [--json]`: what a guidance record holds.

Prints the model shape, the TRACE config, the record's identity (where the format has one), the number
of token rows, each layer's guidance mode, and the payload bytes per site and per layer and site.
`--verify` re-checks every tensor's SHA-256 against the record's metadata and reports each one (OK,
damaged, missing, unexpected) instead of stopping at the first, so one can see how much of a damaged
record is still intact. A file that cannot be read as a record at all is one line and exit status 2;
`--verify` finding damage exits 1.
"""

import json
import struct
import sys
from pathlib import Path

import trace_kernels as tk
from trace_kernels.records.integrity import tensor_digest

HANDLE_PREFIX = "trace-fp4:"


class InspectError(RuntimeError):
    """The argument is not a readable record (missing file, unknown handle, damaged beyond reading)."""


def _load(target: str):
    """(record or None, raw bytes or None, source, load error or None)."""
    path = Path(target)
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InspectError(f"{path}: cannot read ({e.strerror or e})") from None
        try:
            return tk.GuidanceRecord.from_bytes(data, source=str(path)), data, str(path), None
        except tk.RecordError as e:
            return None, data, str(path), e
    if target.startswith(HANDLE_PREFIX):
        try:
            from trace_kernels import stores
        except ImportError:
            raise InspectError(f"{target}: record stores are not available in this version") from None
        try:
            # The user names the store here, so any store opens, but read-only: nothing is created or taken.
            return stores.peek(target), None, target, None
        except tk.RecordError as e:
            return None, None, target, e
        except (KeyError, ValueError, OSError) as e:
            raise InspectError(f"{target}: {e}") from None
    raise InspectError(f"{target}: no such file (and not a record handle '{HANDLE_PREFIX}...')")


def _header(data: bytes) -> dict:
    """The safetensors header of `data` (RecordError if unreadable)."""
    if len(data) < 8:
        raise tk.RecordError(f"truncated ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise tk.RecordError(f"truncated (header says {n} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise tk.RecordError(f"damaged header ({e})") from None
    if not isinstance(header, dict):
        raise tk.RecordError("damaged header (not a JSON object)")
    return header


def verify_tensors(data: bytes) -> list[tuple[str, str]]:
    """[(tensor name, "ok" | "damaged" | "missing" | "unexpected")] for every tensor the record's
    checksums name or the file holds. RecordError if the header or the tensor data cannot be read."""
    from safetensors.torch import load as st_load

    meta = _header(data).get("__metadata__") or {}
    try:
        checksums = json.loads(meta["checksums"])
        assert isinstance(checksums, dict)
    except (KeyError, ValueError, TypeError, AssertionError):
        raise tk.RecordError("damaged metadata: no readable checksums") from None
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors' own error types
        raise tk.RecordError(f"damaged safetensors data ({e})") from None
    out = []
    for name in sorted(set(checksums) | set(tensors)):
        if name not in tensors:
            out.append((name, "missing"))
        elif name not in checksums:
            out.append((name, "unexpected"))
        else:
            out.append((name, "ok" if tensor_digest(tensors[name]) == checksums[name] else "damaged"))
    return out


def _bytes_by_layer(record) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for name, t in record.tensors.items():
        parts = name.split(".")  # layer.<L>.<site>.<part> or layer.<L>.routed_experts
        site = "routing" if parts[2] == "routed_experts" else parts[2]
        row = out.setdefault(int(parts[1]), {})
        row[site] = row.get(site, 0) + t.numel() * t.element_size()
    return dict(sorted(out.items()))


def summary(record) -> dict:
    identity = getattr(record, "identity", None)
    if identity is not None and not isinstance(identity, dict):
        identity = identity.__dict__ if hasattr(identity, "__dict__") else str(identity)
    return {
        "model_shape": dict(record.shape.__dict__),
        "config": record.config.to_dict(),
        "identity": identity,
        "metadata": None if callable(getattr(record, "metadata", None)) else getattr(record, "metadata", None),
        "num_tokens": record.num_tokens,
        "layer_modes": list(record.modes),
        "payload_bytes": record.nbytes,
        "bytes_per_token": record.nbytes / max(record.num_tokens, 1),
        "bytes_by_site": record.size_by_site(),
        "bytes_by_layer_and_site": {str(k): v for k, v in _bytes_by_layer(record).items()},
    }


def _print_summary(source: str, s: dict, file_bytes: int | None) -> None:
    print(f"record: {source}" + (f" ({file_bytes} bytes)" if file_bytes is not None else ""))
    print("model shape: " + ", ".join(f"{k}={v}" for k, v in s["model_shape"].items()))
    print(f"config: {json.dumps(s['config'], sort_keys=True)}")
    if s["identity"] is not None:
        print(f"identity: {json.dumps(s['identity'], sort_keys=True, default=str)}")
    if s["metadata"] is not None:
        print(f"metadata: {json.dumps(s['metadata'], sort_keys=True, default=str)}")
    print(f"tokens: {s['num_tokens']}")
    print("layer modes: " + ", ".join(f"{i}: {m or 'unguided'}" for i, m in enumerate(s["layer_modes"])))
    print(f"payload: {s['payload_bytes']} bytes ({s['bytes_per_token']:.1f} per token)")
    print("bytes by site: " + ", ".join(f"{k} {v}" for k, v in sorted(s["bytes_by_site"].items())))
    sites = sorted({site for row in s["bytes_by_layer_and_site"].values() for site in row})
    print("  layer " + " ".join(f"{site:>11}" for site in sites))
    for layer, row in s["bytes_by_layer_and_site"].items():
        print(f"  {layer:>5} " + " ".join(f"{row.get(site, 0):>11}" for site in sites))


def run_inspect(args) -> int:
    record, data, source, error = _load(args.record)
    rc = 0
    if args.verify:
        if data is None:
            # A handle: the store handed over a record that was verified when it was decoded.
            if error is not None:
                raise InspectError(f"{source}: {error}")
            print(f"{source}: every checksum verified when the store decoded it")
        else:
            try:
                results = verify_tensors(data)
            except tk.RecordError as e:
                raise InspectError(f"{source}: {e}") from None
            for name, status in results:
                print(f"{status.upper():>10}  {name}")
            bad = [n for n, st in results if st != "ok"]
            print(f"{source}: {len(results) - len(bad)} of {len(results)} tensors OK" + (f", {len(bad)} not" if bad else ""))
            if bad or error is not None:
                rc = 1
    if record is None:
        if args.verify:
            print(f"{source}: {error}", file=sys.stderr)
            return 1
        raise InspectError(str(error))
    s = summary(record)
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True, default=str))
    else:
        _print_summary(source, s, len(data) if data is not None else None)
    return rc
