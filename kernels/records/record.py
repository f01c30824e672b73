"""GuidanceRecord: one sample's guidance, what the trainer rounds toward (docs/record-format.md).

A record holds, for each guided layer and site, one row per token that went through the rollout model
(prompt and generated), plus the routed expert ids of every MoE layer for routing replay:

  site          rows per token                      row shape
  moe_fc1_in    1                                   [hidden_size]
  moe_fc2_in    top_k (router's slot order)         [top_k, moe_intermediate_size]
  k, v          num_kv_heads                        [num_kv_heads, head_dim]

Each guided layer has one encoding (a Guide type: full, compact or sparse, see trace_kernels.guides);
layers without one keep only their routing.

On disk it is a safetensors file whose metadata makes it self-describing: format name and version, the
model shape, the TRACE config, the number of tokens, the encoding of each layer, the record's identity
(identity.py: the token ids it belongs to and the weights that made it), and a SHA-256 per tensor, so a
damaged tensor is reported by layer and site (integrity.py).
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..config import RATE_KEYS, TraceConfig
from ..errors import RecordError, SparseError
from ..guides.base import Guide
from ..identity import RecordIdentity
from ..model_shape import ModelShape
from .integrity import (
    FORMAT_NAME, FORMAT_VERSION, canonical_header, metadata_digest, parse_metadata, read_header, signed_metadata_json,
    tensor_digest, verify, verify_layout,
)
from . import safetensors_bytes, written
from .layout import guide_type, packs_routing, routing_name, site_rows, tensor_name
from .routing import pack_routing, unpack_routing
from .sparse_parts import encode_site, is_audit_part
from ..guides.sparse import SparseGuide
from ..guides.sparse.wire import unpack_fields_many
from ..guides.sparse.audit import PARTS as AUDIT_PARTS, from_parts_host
from ..identity import describe


def _shape_json(shape: ModelShape) -> str:
    """The model_shape metadata text. A ModelShape is frozen and its fields are ints, tuples and a str, so
    equal shapes give the same text: made once per shape (a take writes it into every record)."""
    try:
        return _SHAPE_JSON[shape]
    except KeyError:
        text = _SHAPE_JSON[shape] = json.dumps(shape.to_dict(), sort_keys=True)
        if len(_SHAPE_JSON) > 64:  # a process sees a handful of shapes; never grow without bound
            _SHAPE_JSON.pop(next(iter(_SHAPE_JSON)))
        return text
    except TypeError:  # a field that is not hashable (not a shape __post_init__ accepts): made each time
        return json.dumps(shape.to_dict(), sort_keys=True)


_SHAPE_JSON: dict = {}


class GuidanceRecord:
    """An encoded record. Build with `RecordBuilder`; read with `load` / `from_bytes`."""

    def __init__(self, shape: ModelShape, config: TraceConfig, num_tokens: int, modes, tensors,
                 identity: RecordIdentity | None = None):
        self.shape = shape
        self.config = config
        self.num_tokens = num_tokens
        self.modes: tuple = tuple(modes)  # per layer: "full", "compact", "sparse" or None
        self.tensors: dict[str, torch.Tensor] = tensors
        # What the record belongs to (token digest, weights); unknown fields stay None.
        self.identity: RecordIdentity = identity or RecordIdentity(num_tokens=num_tokens)
        self.origin: str | None = None  # the file or handle it was read from (named in refusals)
        # (config, config.to_json()) when the maker has the text already (the take: one text for all its
        # records); used by _metadata only while `config` is still this record's config.
        self.config_text: tuple | None = None
        # {name: (tensor, its bytes)} when the maker cut every tensor from buffers it holds (the engine's take:
        # engine/take.py `_pieces`, 1-D uint8 CPU views and memoryviews of its kernel outputs; only such
        # tensors): take_bytes joins those bytes instead of a `.numpy()` of each tensor, for the tensors still
        # in `tensors` (identity-checked)
        self.host_bytes: dict | None = None
        if self.identity.num_tokens not in (None, num_tokens):
            raise RecordError(f"record identity covers {self.identity.num_tokens} tokens, the record has {num_tokens} rows")

    # ---- access -------------------------------------------------------------------------------
    def site(self, layer: int, site: str) -> Guide | None:
        """The guide for `site` of `layer` ([T, *row_shape]), or None where the layer is not guided. A
        SparseGuide is resolved by the trainer with its own values (`Guide.rounding_target`)."""
        self.shape.row_shape(site)  # validates the site name
        if site not in self.shape.layer_sites(layer):
            raise RecordError(f"record: layer {layer} has no site {site} (its sites: {self.shape.layer_sites(layer)})")
        kind = guide_type(self.modes[layer])
        if kind is None:
            return None
        lead, K = site_rows(self.shape, self.num_tokens, site)
        parts = {part: self.tensors[tensor_name(layer, site, part)] for part in kind.record_layout(lead, K)}
        try:
            return kind.from_record_parts(parts, lead, K)
        except SparseError as e:
            raise RecordError(f"record: layer {layer}, site {site}: {e}") from None

    @staticmethod
    def site_of_all(records: list["GuidanceRecord"], layer: int, site: str) -> Guide | None:
        """`site(layer, site)` of every record, their rows concatenated (`Guide.cat`), or None where the
        layer is not guided. A sparse site's payloads unpack in one call for all records (a trainer's
        micro-batch reads each (layer, site) of all its samples at once), with each payload checked and
        named in a refusal as `site` does."""
        kinds = {guide_type(r.modes[layer]) for r in records}
        if len(kinds) != 1 or next(iter(kinds)) is not SparseGuide or len(records) < 2:
            parts = [r.site(layer, site) for r in records]
            return None if not parts or parts[0] is None else type(parts[0]).cat(parts)
        for r in records:
            r.shape.row_shape(site)  # validates the site name
            if site not in r.shape.layer_sites(layer):
                raise RecordError(f"record: layer {layer} has no site {site} (its sites: {r.shape.layer_sites(layer)})")
        rows = [site_rows(r.shape, r.num_tokens, site) for r in records]
        Ks = {K for _, K in rows}
        if len(Ks) != 1:
            raise RecordError(f"records of layer {layer}, site {site} have rows of different widths {sorted(Ks)}")
        name = tensor_name(layer, site, "sparse")
        try:
            fields = unpack_fields_many([r.tensors[name] for r in records], [lead for lead, _ in rows], Ks.pop(),
                                        where=lambda i: describe(records[i], f"record {i}"))
        except SparseError as e:
            raise RecordError(f"record: layer {layer}, site {site}: {e}") from None
        return SparseGuide(*fields)

    def audit(self, layer: int, site: str):
        """(token rows int64 [n], their packed 4-bit codes uint8 [n, ..., K // 2]) of a sparse layer's
        audit, or None where the record has none (not sparse, audit off, or made before audits existed)."""
        found = self._audit_parts(layer, site)
        if found is None:
            return None
        from ..guides.sparse.audit import from_parts

        return from_parts(*found)

    def audit_host(self, layer: int, site: str):
        """`audit(layer, site)` as numpy arrays (audit.from_parts_host), for a record whose audit tensor is
        on the host; None where the record has none, or where it is not on the host (then read `audit`).
        A trainer's batch asks this of every record, layer and site (64 a step in the bench), and most
        audits are empty (0.25% of a site's rows): those are answered without from_parts_host."""
        if self.modes[layer] != "sparse":
            return None
        parts = {p: t for p in AUDIT_PARTS if (t := self.tensors.get(tensor_name(layer, site, p))) is not None}
        if not parts:
            return None
        for t in parts.values():
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return None
        lead, K = site_rows(self.shape, self.num_tokens, site)
        blob = parts.get("audit")
        if (len(parts) == 1 and blob is not None and blob.dtype == torch.uint8 and blob.dim() == 1
                and blob.numel() == 0):
            # no audited row: what from_parts_host returns for it (n = 0 passes its size and row checks)
            return np.empty(0, np.int64), np.empty((0, *lead[1:], K // 2), np.uint8)
        return from_parts_host(parts, lead, K, f"record: layer {layer}, site {site}")

    def _audit_parts(self, layer: int, site: str):
        """(the audit's tensors by part, the site's row lead, K, a name for errors) as `audit.from_parts`
        takes them, or None where the record has no audit of (layer, site)."""
        if self.modes[layer] != "sparse":
            return None
        parts = {p: self.tensors[n] for p in AUDIT_PARTS if (n := tensor_name(layer, site, p)) in self.tensors}
        if not parts:
            return None
        lead, K = site_rows(self.shape, self.num_tokens, site)
        return parts, lead, K, f"record: layer {layer}, site {site}"

    def rates(self) -> dict[str, list[int]]:
        """{"<layer>.<site>": [amax_bits, scale_bits, code_bits]}: the rates each sparse payload was
        encoded with, read from the payloads' own headers (what the decoder uses)."""
        from ..guides.sparse.wire import payload_rates

        out = {}
        for layer, mode in enumerate(self.modes):
            if mode != "sparse":
                continue
            for site in self.shape.layer_sites(layer):
                r = payload_rates(self.tensors[tensor_name(layer, site, "sparse")])
                out[f"{layer}.{site}"] = [r.amax_bits, r.scale_bits, r.code_bits]
        return out

    def guide_type(self, layer: int) -> type[Guide] | None:
        """The Guide type of `layer`'s encoding; None where the layer is not guided."""
        return guide_type(self.modes[layer])

    def routed_experts(self, layer: int) -> torch.Tensor:
        """int64 [T, top_k]: the rollout's expert ids of each token, in the router's slot order."""
        if not self.shape.has_moe(layer):
            raise RecordError(f"record: layer {layer} has no routed experts (a dense layer), so no routing ids")
        if packs_routing(self.modes[layer]):
            s = self.shape
            return unpack_routing(self.tensors[routing_name(layer, True)], self.num_tokens, s.top_k, s.num_experts)
        return self.tensors[routing_name(layer, False)].to(torch.int64)

    @property
    def nbytes(self) -> int:
        """Payload bytes (all tensors); `len(to_bytes())` adds the safetensors header."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def size_by_site(self) -> dict[str, int]:
        """Payload bytes per site (summed over layers) and for the routing ids."""
        out: dict[str, int] = {}
        for name, t in self.tensors.items():
            key = name.split(".")[2]
            out[key] = out.get(key, 0) + t.numel() * t.element_size()
        return out

    def check_compatible(self, shape: ModelShape, config: TraceConfig | None = None, *, source="record"):
        """Raise RecordError unless this record was made for `shape` (and `config`, if given)."""
        if shape != self.shape:
            diffs = [
                f"{f.name}: record {getattr(self.shape, f.name)} vs model {getattr(shape, f.name)}"
                for f in dataclasses.fields(shape)
                if getattr(shape, f.name) != getattr(self.shape, f.name)
            ]
            raise RecordError(f"{source}: made for another model shape ({'; '.join(diffs)})")
        # The sparse rates and the audit fraction may differ (a record made one rate update ago): every
        # payload carries its own rates, so it decodes exactly whatever the trainer's current rates are.
        # Equal configs (every field) give equal dicts: the dicts (two deep copies each time, ~8 a trainer
        # step for 4 records) are made only where the configs differ, to tell a rate change from a refusal.
        if config is None or config == self.config:
            return
        mine = {k: v for k, v in self.config.to_dict().items() if k not in RATE_KEYS}
        theirs = {k: v for k, v in config.to_dict().items() if k not in RATE_KEYS}
        if mine != theirs:
            keys = sorted(set(mine) | set(theirs), key=lambda k: (k not in mine, k))  # optional keys may be absent
            diffs = [f"{k}: record {mine.get(k)!r} vs expected {theirs.get(k)!r}" for k in keys if mine.get(k) != theirs.get(k)]
            raise RecordError(f"{source}: made with another TRACE config ({'; '.join(diffs)})")

    def reencode(self, config: TraceConfig) -> "GuidanceRecord":
        """The same guidance under another config's layer modes: full codes can become compact or be
        dropped; a layer cannot gain detail it was not recorded with (RecordError names it)."""
        modes = config.layer_modes(self.shape.num_layers)
        tensors = {}
        for layer, (have, want) in enumerate(zip(self.modes, modes)):
            recorded, wanted = guide_type(have), guide_type(want)
            if want not in (recorded.serves if recorded is not None else (None,)):
                raise RecordError(f"record: layer {layer} was recorded as {have or 'unguided'}, cannot serve {want or 'unguided'}")
            if self.shape.has_moe(layer):
                ids = self.routed_experts(layer)
                packed = packs_routing(want)
                tensors[routing_name(layer, packed)] = (
                    pack_routing(ids, self.shape.num_experts) if packed else ids.to(torch.int16)
                )
            if wanted is None:
                continue
            for site in self.shape.layer_sites(layer):
                lead, K = site_rows(self.shape, self.num_tokens, site)
                if want == have:  # kept as recorded, byte for byte (with its audit, if any)
                    parts = {part: self.tensors[tensor_name(layer, site, part)] for part in wanted.record_layout(lead, K)}
                    prefix = tensor_name(layer, site, "")
                    parts.update({n[len(prefix):]: t for n, t in self.tensors.items()
                                  if n.startswith(prefix) and is_audit_part(n)})
                else:
                    parts = encode_site(wanted, self.site(layer, site), config, layer, site, self.identity.token_digest)
                for part, t in parts.items():
                    tensors[tensor_name(layer, site, part)] = t
        return GuidanceRecord(self.shape, config, self.num_tokens, modes, tensors, self.identity)

    def with_identity(self, **fields) -> "GuidanceRecord":
        """The same record with identity fields replaced (e.g. a weights version set by the RL driver)."""
        return GuidanceRecord(self.shape, self.config, self.num_tokens, self.modes, self.tensors,
                              dataclasses.replace(self.identity, **fields))

    # ---- serialisation ------------------------------------------------------------------------
    def _metadata(self, checksums: dict[str, str] | None = None) -> dict[str, str]:
        """`checksums`: each tensor's tensor_digest when the caller has them (to_bytes)."""
        meta = self._metadata_fields(checksums)
        meta["metadata_checksum"] = metadata_digest(meta)
        return meta

    def _metadata_fields(self, checksums: dict[str, str] | None = None) -> dict[str, str]:
        """`_metadata` without its metadata_checksum."""
        if checksums is None:
            checksums = {k: tensor_digest(v) for k, v in self.tensors.items()}
        return {
            "format": FORMAT_NAME,
            "version": str(FORMAT_VERSION),
            "model_shape": _shape_json(self.shape),
            "config": self.config_text[1] if self.config_text and self.config_text[0] is self.config else self.config.to_json(),
            "num_tokens": str(self.num_tokens),
            "layer_modes": json.dumps(list(self.modes)),
            "identity": json.dumps(self.identity.to_dict(), sort_keys=True),
            "checksums": json.dumps(checksums, sort_keys=True),
        }

    def __getstate__(self) -> dict:
        """Pickled (a user's copy of a take's record) without `host_bytes`: memoryviews do not pickle, and the
        tensors carry the same bytes."""
        state = dict(self.__dict__)
        state["host_bytes"] = None
        return state

    def to_bytes(self, keep_for_reader: bool = False) -> bytes:
        """Safetensors bytes; deterministic (the same record gives the same bytes in every process), so
        a record that travelled through a store can be compared byte for byte with the inline one.
        `keep_for_reader`: a reader in this process will read these bytes back (the vLLM worker's take
        for an in-process driver): what the writer knows is kept with them (records/written.py)."""
        tensors = self.tensors
        # The tensors joined once into the file's body and each hashed where it lies there; the metadata's
        # values escaped once for its digest and for the header (safetensors_bytes.py, integrity.py).
        # record_body is None where a dtype is not one it writes (what `writable` tells, asked only then).
        found = None if "__metadata__" in tensors else safetensors_bytes.record_body(tensors)
        if found is None and not safetensors_bytes.writable(tensors):
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            return canonical_header(st_save(tensors, metadata=self._metadata()))
        if found is None:  # a tensor named like the metadata: save_layout's header dict
            raw, checksums = safetensors_bytes.bytes_and_digests(tensors)
            meta = self._metadata_fields(checksums)
            meta["metadata_checksum"], meta_json = signed_metadata_json(meta)
            data, n, entries = safetensors_bytes.save_layout(tensors, raw, meta, meta_json)
        else:
            body, entries, texts, checksums = found
            meta = self._metadata_fields(checksums)
            meta["metadata_checksum"], meta_json = signed_metadata_json(meta)
            data, n = safetensors_bytes.with_header(body, texts, meta_json)
        if keep_for_reader:
            written.keep(data, written.Kept(self, checksums, n, entries))
        return data

    def save(self, path) -> int:
        """Write to `path`; returns the file size in bytes."""
        data = self.to_bytes()
        Path(path).write_bytes(data)
        return len(data)

    @classmethod
    def load(cls, path, *, expect_shape: ModelShape | None = None, expect_config: TraceConfig | None = None):
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise RecordError(f"{path}: cannot read guidance record ({e})") from e
        return cls.from_bytes(data, source=str(path), expect_shape=expect_shape, expect_config=expect_config)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "record", expect_shape=None, expect_config=None):
        kept = written.take(data)
        if kept is not None:  # the very bytes this process just wrote: not parsed back (records/written.py)
            return cls._read_kept(data, kept, source, expect_shape, expect_config)
        meta, header, n = read_header(data, source)
        # A file as to_bytes writes it is read directly; anything else by safetensors, which refuses
        # what it always refused (load_plain's conditions are safetensors' checks and stricter).
        plain = safetensors_bytes.load_plain(data, header, n)
        tensors, digests = plain if plain is not None else (None, None)
        if plain is None:
            # counted like the take's per-record builds: a record not read the direct way is never silent
            from .. import cpu_native

            cpu_native.FALLBACKS["safetensors_load:record_read"] += 1
            try:
                tensors = st_load(data)
            except Exception as e:  # safetensors raises its own error types for truncated / corrupt data
                raise RecordError(f"{source}: damaged safetensors data ({e})") from e
        shape, config, num_tokens, modes, checksums, identity = parse_metadata(meta, source)
        try:
            record = cls(shape, config, num_tokens, modes, tensors, identity)
        except RecordError as e:
            raise RecordError(f"{source}: {e}") from e
        verify(record, checksums, source, digests)
        record.origin = source
        if expect_shape is not None or expect_config is not None:
            record.check_compatible(expect_shape or shape, expect_config, source=source)
        return record

    @classmethod
    def _read_kept(cls, data: bytes, kept, source: str, expect_shape, expect_config):
        """`from_bytes` of bytes this process wrote (`written.take` found them): the metadata's objects
        as the writer had them; the tensors copied out of the bytes, not hashed again (the writer hashed
        the immutable body this immutable file was joined from: records/written.py's trust rule), then
        `verify_layout`: `verify`'s layout checks (names, shapes, dtypes), not its checksums."""
        tensors = safetensors_bytes.copy_tensors(data, 8 + kept.header_len, kept.entries, kept.empties)
        try:
            record = cls(kept.shape, kept.config, kept.num_tokens, kept.modes, tensors, kept.identity)
        except RecordError as e:
            raise RecordError(f"{source}: {e}") from e
        verify_layout(record, source)  # names, shapes, dtypes; not the checksums (written.py's trust rule)
        written.READ_BACK["same_process"] += 1
        record.origin = source
        if expect_shape is not None or expect_config is not None:
            record.check_compatible(expect_shape or kept.shape, expect_config, source=source)
        return record
