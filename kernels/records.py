"""Guidance records (DESIGN.md section 5): one per sample, what the trainer rounds toward.

A record holds, for each guided layer and site, one row per token that went through the rollout model
(prompt and generated), plus the routed expert ids of every layer for routing replay:

  site          rows per token                      row shape
  moe_fc1_in    1                                   [hidden_size]
  moe_fc2_in    top_k (router's slot order)         [top_k, moe_intermediate_size]
  k, v          num_kv_heads                        [num_kv_heads, head_dim]

Encodings per layer: `full` (4-bit codes + E4M3 scales + float32 global amax per row), `compact`
(1 mantissa bit per element + scales + amax) or `sparse` (syndromes of what the trainer cannot infer
from its own values, one uint8 payload per site, and routing ids bit-packed: sparse_guidance.py).
Layers with no guidance mode keep only their routing.

On disk it is a safetensors file. Its metadata makes it self-describing: format name and version, the
model shape, the TRACE config, the number of tokens, the mode of each layer, and a SHA-256 per tensor,
so a damaged tensor is reported by layer and site. Version 2 adds the record's identity (identity.py):
the digest of the token ids it belongs to and the weights version / digest that made it. Version-1
records carry no identity and are refused (re-capture them).
"""

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .config import ALL_SITES, MOE_SITES, SITES, TraceConfig
from .format import BLOCK_SIZE
from . import sparse_guidance
from .identity import RecordIdentity, num_ids, token_digest
from .sparse_guidance import SparseError, SparseGuide
from .tensor import CompactGuide, NVFP4Tensor, compact

FORMAT_NAME = "trace-fp4-guidance"
FORMAT_VERSION = 3
# Version 2 records (every layer MoE with standard K/V, the only shape then) read as they are: their
# model_shape has none of version 3's per-layer fields, whose defaults say exactly that.
READABLE_VERSIONS = ("2", "3")
ENCODINGS = ("full", "compact", "sparse")


class RecordError(ValueError):
    """A guidance record that cannot be used: damaged, or made for another model or config."""


KV_KINDS = ("kv", "mla")


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions a record belongs to, layer by layer.

    Not every layer of the models people RL-train has routed experts and a K/V cache: DeepSeek-V3 and
    GLM-4.5 start with dense-MLP layers, Qwen3-Next's linear-attention layers keep no KV cache. So:
    - `moe_layers`: the layers with routed experts (None: every layer); only they have routing ids and
      the moe_fc1_in / moe_fc2_in sites.
    - `kv_layers`: the layers with a KV cache (None: every layer).
    - `kv_kind`: "kv", standard K/V rows [num_kv_heads, head_dim] (sites k, v); or "mla", the one
      latent row MLA caches per token (site kv_latent, rows [1, head_dim] with head_dim = kv_lora_rank
      and num_kv_heads = 1). MLA's rope part k_pe stays in the model dtype: it is 1/9 of the row and
      carries the positions.
    top_k, num_experts and moe_intermediate_size are the same in every MoE layer of these models.
    """

    num_layers: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...] | None = None
    kv_layers: tuple[int, ...] | None = None
    kv_kind: str = "kv"

    def __post_init__(self):
        for f in dataclasses.fields(self)[:7]:
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{f.name} must be a positive int, got {v!r}")
        for name in ("hidden_size", "moe_intermediate_size", "head_dim"):
            if getattr(self, name) % BLOCK_SIZE:
                raise ValueError(
                    f"ModelShape.{name}={getattr(self, name)} is not divisible by {BLOCK_SIZE}: NVFP4 "
                    f"quantizes blocks of {BLOCK_SIZE} along it"
                )
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelShape.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts > torch.iinfo(torch.int16).max:
            raise ValueError(f"ModelShape.num_experts={self.num_experts} does not fit the int16 routing ids")
        for name in ("moe_layers", "kv_layers"):
            layers = getattr(self, name)
            if layers is None:
                continue
            if isinstance(layers, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers
            ):
                raise ValueError(f"ModelShape.{name} must be layer indices or None, got {layers!r}")
            layers = tuple(sorted(set(layers)))
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"ModelShape.{name}={list(layers)} outside the {self.num_layers} layers")
            # Normalised: a shape that names every layer is the same shape as None (compares equal).
            object.__setattr__(self, name, None if layers == tuple(range(self.num_layers)) else layers)
        if self.moe_layers == ():
            raise ValueError("ModelShape.moe_layers is empty: TRACE needs at least one routed-expert layer")
        if self.kv_kind not in KV_KINDS:
            raise ValueError(f"ModelShape.kv_kind must be one of {KV_KINDS}, got {self.kv_kind!r}")
        if self.kv_kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(
                f"ModelShape: kv_kind='mla' caches one latent row per token (num_kv_heads=1), got "
                f"num_kv_heads={self.num_kv_heads}"
            )

    # ---- per layer ------------------------------------------------------------------------------
    def has_moe(self, layer: int) -> bool:
        return self.moe_layers is None or layer in self.moe_layers

    def has_kv(self, layer: int) -> bool:
        return self.kv_layers is None or layer in self.kv_layers

    def moe_layer_list(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.has_moe(i)]

    def kv_layer_list(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.has_kv(i)]

    def kv_sites(self) -> tuple[str, ...]:
        return ("kv_latent",) if self.kv_kind == "mla" else ("k", "v")

    def layer_sites(self, layer: int) -> tuple[str, ...]:
        """The captured sites of `layer`, in record order."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range for a model of {self.num_layers} layers")
        return (MOE_SITES if self.has_moe(layer) else ()) + (self.kv_sites() if self.has_kv(layer) else ())

    def row_shape(self, site: str) -> tuple[int, ...]:
        """Shape of one token's data at `site`."""
        if site == "moe_fc1_in":
            return (self.hidden_size,)
        if site == "moe_fc2_in":
            return (self.top_k, self.moe_intermediate_size)
        if site in self.kv_sites():
            return (self.num_kv_heads, self.head_dim)
        if site in ALL_SITES:
            raise ValueError(f"site {site!r} does not exist in a model with kv_kind={self.kv_kind!r}")
        raise ValueError(f"unknown site {site!r}; sites are {ALL_SITES}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("moe_layers", "kv_layers"):
            if d[name] is not None:
                d[name] = list(d[name])
        return d

    def describe_layers(self) -> list[str]:
        """One word per layer for tables: which sites it has ("moe+kv", "dense+kv", "moe", ...)."""
        kv = "mla" if self.kv_kind == "mla" else "kv"
        return [
            ("moe" if self.has_moe(i) else "dense") + (f"+{kv}" if self.has_kv(i) else "")
            for i in range(self.num_layers)
        ]


def _name(layer: int, site: str, part: str) -> str:
    return f"layer.{layer}.{site}.{part}"


def _routing_name(layer: int) -> str:
    return f"layer.{layer}.routed_experts"


def _packed_routing_name(layer: int) -> str:
    return f"layer.{layer}.routed_packed"


def _id_bits(num_experts: int) -> int:
    return max(1, (num_experts - 1).bit_length())


def _pack_routing(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int [T, top_k] -> uint8 [ceil(T * top_k * b / 8)], b = bits per expert id, LSB first."""
    b = _id_bits(num_experts)
    bits = ((ids.reshape(-1, 1).to(torch.int64) >> torch.arange(b)) & 1).reshape(-1)
    bits = torch.cat([bits, torch.zeros((-bits.numel()) % 8, dtype=torch.int64)]).reshape(-1, 8)
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8)


def _unpack_routing(packed: torch.Tensor, T: int, top_k: int, num_experts: int) -> torch.Tensor:
    b = _id_bits(num_experts)
    bits = ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)[: T * top_k * b]
    return (bits.reshape(T * top_k, b) << torch.arange(b)).sum(-1).reshape(T, top_k)


def _digest(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _sparse_payload(q: NVFP4Tensor | CompactGuide, site: str) -> torch.Tensor:
    return sparse_guidance.pack(sparse_guidance.encode(q, site))


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
        if self.identity.num_tokens not in (None, num_tokens):
            raise RecordError(f"record identity covers {self.identity.num_tokens} tokens, the record has {num_tokens} rows")

    # ---- access -------------------------------------------------------------------------------
    def site(self, layer: int, site: str) -> NVFP4Tensor | CompactGuide | SparseGuide | None:
        """The guide for `site` of `layer` ([T, *row_shape]), or None where the layer is not guided. A
        SparseGuide is decoded by the trainer with its own values (`sparse_guidance.decode`)."""
        row = self.shape.row_shape(site)  # validates the site name
        if site not in self.shape.layer_sites(layer):
            raise RecordError(f"record: layer {layer} has no site {site} (its sites: {self.shape.layer_sites(layer)})")
        mode = self.modes[layer]
        if mode is None:
            return None
        if mode == "sparse":
            try:
                return sparse_guidance.unpack(self.tensors[_name(layer, site, "sparse")], (self.num_tokens, *row[:-1]), row[-1])
            except SparseError as e:
                raise RecordError(f"record: layer {layer}, site {site}: {e}") from None
        scales = self.tensors[_name(layer, site, "scales")]
        amax = self.tensors[_name(layer, site, "amax")]
        if mode == "full":
            return NVFP4Tensor(self.tensors[_name(layer, site, "codes")], scales, amax)
        return CompactGuide(self.tensors[_name(layer, site, "mbits")], scales, amax)

    def routed_experts(self, layer: int) -> torch.Tensor:
        """int64 [T, top_k]: the rollout's expert ids of each token, in the router's slot order."""
        if not self.shape.has_moe(layer):
            raise RecordError(f"record: layer {layer} has no routed experts (a dense layer), so no routing ids")
        if self.modes[layer] == "sparse":
            s = self.shape
            return _unpack_routing(self.tensors[_packed_routing_name(layer)], self.num_tokens, s.top_k, s.num_experts)
        return self.tensors[_routing_name(layer)].to(torch.int64)

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
        if config is not None and config != self.config:
            mine, theirs = self.config.to_dict(), config.to_dict()
            diffs = [f"{k}: record {mine[k]!r} vs expected {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
            raise RecordError(f"{source}: made with another TRACE config ({'; '.join(diffs)})")

    def reencode(self, config: TraceConfig) -> "GuidanceRecord":
        """The same guidance under another config's layer modes: full codes can become compact or be
        dropped; a layer cannot gain detail it was not recorded with (RecordError names it)."""
        modes = config.layer_modes(self.shape.num_layers)
        tensors = {}
        for layer, (have, want) in enumerate(zip(self.modes, modes)):
            if have == "sparse" and want != "sparse":
                raise RecordError(f"record: layer {layer} was recorded as sparse, cannot serve {want or 'unguided'}")
            if self.shape.has_moe(layer):
                ids = self.routed_experts(layer)
                if want == "sparse":
                    tensors[_packed_routing_name(layer)] = _pack_routing(ids, self.shape.num_experts)
                else:
                    tensors[_routing_name(layer)] = ids.to(torch.int16)
            if want is None:
                continue
            if have is None or (have == "compact" and want == "full"):
                raise RecordError(f"record: layer {layer} was recorded as {have or 'unguided'}, cannot serve {want}")
            for site in self.shape.layer_sites(layer):
                if want == "sparse":
                    # the syndromes need only mantissa bits, scale LSBs and amax: full or compact will do
                    name = _name(layer, site, "sparse")
                    tensors[name] = self.tensors[name] if have == "sparse" else _sparse_payload(self.site(layer, site), site)
                    continue
                q = self.site(layer, site)
                if want == "compact" and have == "full":
                    q = compact(q)
                payload = "codes" if want == "full" else "mbits"
                tensors[_name(layer, site, payload)] = getattr(q, payload)
                tensors[_name(layer, site, "scales")] = q.scales
                tensors[_name(layer, site, "amax")] = q.global_amax
        return GuidanceRecord(self.shape, config, self.num_tokens, modes, tensors, self.identity)

    def with_identity(self, **fields) -> "GuidanceRecord":
        """The same record with identity fields replaced (e.g. a weights version set by the RL driver)."""
        return GuidanceRecord(self.shape, self.config, self.num_tokens, self.modes, self.tensors,
                              dataclasses.replace(self.identity, **fields))

    # ---- serialisation ------------------------------------------------------------------------
    def _metadata(self) -> dict[str, str]:
        meta = {
            "format": FORMAT_NAME,
            "version": str(FORMAT_VERSION),
            "model_shape": json.dumps(self.shape.to_dict(), sort_keys=True),
            "config": self.config.to_json(),
            "num_tokens": str(self.num_tokens),
            "layer_modes": json.dumps(list(self.modes)),
            "identity": json.dumps(self.identity.to_dict(), sort_keys=True),
            "checksums": json.dumps({k: _digest(v) for k, v in sorted(self.tensors.items())}, sort_keys=True),
        }
        meta["metadata_checksum"] = _metadata_digest(meta)
        return meta

    def to_bytes(self) -> bytes:
        """Safetensors bytes; deterministic (the same record gives the same bytes in every process), so
        a record that travelled through a store can be compared byte for byte with the inline one."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        return _canonical_header(st_save(tensors, metadata=self._metadata()))

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
        meta = _read_metadata(data, source)
        try:
            tensors = st_load(data)
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt data
            raise RecordError(f"{source}: damaged safetensors data ({e})") from e
        shape, config, num_tokens, modes, checksums, identity = _parse_metadata(meta, source)
        try:
            record = cls(shape, config, num_tokens, modes, tensors, identity)
        except RecordError as e:
            raise RecordError(f"{source}: {e}") from e
        _verify(record, checksums, source)
        record.origin = source
        if expect_shape is not None or expect_config is not None:
            record.check_compatible(expect_shape or shape, expect_config, source=source)
        return record


def _canonical_header(data: bytes) -> bytes:
    """safetensors writes `__metadata__` from a hash map (key order varies between calls): rewrite the
    header with sorted metadata keys, padded to 8 bytes as safetensors does (offsets are relative to the
    end of the header, so the tensor bytes stay as they are)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(meta.items()))} if meta is not None else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def _read_metadata(data: bytes, source: str) -> dict[str, str]:
    if len(data) < 8:
        raise RecordError(f"{source}: truncated ({len(data)} bytes), not a guidance record")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise RecordError(f"{source}: truncated (header says {n} bytes, file has {len(data) - 8})")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:  # UnicodeDecodeError included
        raise RecordError(f"{source}: damaged header ({e})") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        meta = {}
    if meta.get("format") != FORMAT_NAME:
        raise RecordError(f"{source}: not a trace-fp4 guidance record (format {meta.get('format')!r})")
    if meta.get("version") == "1":
        raise RecordError(
            f"{source}: guidance format version 1 (records without identity: no token digest, no weights "
            f"version); this trace-fp4 reads version {FORMAT_VERSION}: re-capture the record"
        )
    if meta.get("version") not in READABLE_VERSIONS:
        raise RecordError(
            f"{source}: guidance format version {meta.get('version')!r}, this trace-fp4 reads versions "
            f"{', '.join(READABLE_VERSIONS)}"
        )
    # The tensors have their own checksums; this one covers the metadata itself (shape, config, modes,
    # identity, the tensor checksums), so a changed header is never read as another valid record.
    if meta.get("metadata_checksum") != _metadata_digest(meta):
        raise RecordError(f"{source}: metadata checksum mismatch (damaged or edited header)")
    return meta


def _metadata_digest(meta: dict[str, str]) -> str:
    body = {k: v for k, v in meta.items() if k != "metadata_checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _parse_metadata(meta: dict[str, str], source: str):
    try:
        shape_fields = json.loads(meta["model_shape"])
        if meta["version"] == "2" and set(shape_fields) & {"moe_layers", "kv_layers", "kv_kind"}:
            raise ValueError("a version-2 record with version-3 shape fields")
        shape = ModelShape(**shape_fields)
        config = TraceConfig.from_dict(json.loads(meta["config"]))
        num_tokens = int(meta["num_tokens"])
        modes = json.loads(meta["layer_modes"])
        checksums = json.loads(meta["checksums"])
        identity = RecordIdentity.from_dict(json.loads(meta["identity"]))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise RecordError(f"{source}: damaged metadata ({e!r})") from e
    if not isinstance(checksums, dict) or not isinstance(modes, list):
        raise RecordError(f"{source}: damaged metadata (checksums / layer_modes of the wrong type)")
    if len(modes) != shape.num_layers or any(m not in (*ENCODINGS, None) for m in modes):
        raise RecordError(f"{source}: layer_modes {modes!r} do not fit {shape.num_layers} layers")
    return shape, config, num_tokens, modes, checksums, identity


def _expected_tensors(shape: ModelShape, T: int, modes) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for layer, mode in enumerate(modes):
        if mode == "sparse":
            if shape.has_moe(layer):
                nbytes = (T * shape.top_k * _id_bits(shape.num_experts) + 7) // 8
                out[_packed_routing_name(layer)] = ((nbytes,), torch.uint8)
            for site in shape.layer_sites(layer):
                out[_name(layer, site, "sparse")] = (None, torch.uint8)  # length: checked by site()
            continue
        if shape.has_moe(layer):
            out[_routing_name(layer)] = ((T, shape.top_k), torch.int16)
        if mode is None:
            continue
        for site in shape.layer_sites(layer):
            row = shape.row_shape(site)
            lead, K = (T, *row[:-1]), row[-1]
            if mode == "full":
                out[_name(layer, site, "codes")] = ((*lead, K // 2), torch.uint8)
            else:
                out[_name(layer, site, "mbits")] = ((*lead, K // 8), torch.uint8)
            out[_name(layer, site, "scales")] = ((*lead, K // BLOCK_SIZE), torch.uint8)
            out[_name(layer, site, "amax")] = (lead, torch.float32)
    return out


def _where(name: str) -> str:
    parts = name.split(".")
    return f"layer {parts[1]}" + (f", site {parts[2]}" if len(parts) > 3 else ", routing ids")


def _verify(record: GuidanceRecord, checksums: dict[str, str], source: str) -> None:
    expected = _expected_tensors(record.shape, record.num_tokens, record.modes)
    for name, (shape, dtype) in expected.items():
        t = record.tensors.get(name)
        if t is None:
            raise RecordError(f"{source}: {_where(name)}: tensor {name} is missing")
        if shape is None:  # a variable-length payload: 1-D here, its length is checked when decoded
            shape = tuple(t.shape) if t.dim() == 1 else ("n",)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise RecordError(
                f"{source}: {_where(name)}: tensor {name} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}"
            )
        if checksums.get(name) != _digest(t):
            raise RecordError(f"{source}: {_where(name)}: checksum mismatch in tensor {name} (damaged data)")
    extra = sorted(set(record.tensors) - set(expected))
    if extra:
        raise RecordError(f"{source}: unexpected tensors {extra}")


class RecordBuilder:
    """Collects one sample's captured NVFP4 rows, in token order, then encodes a GuidanceRecord.

    `add` may be called many times per layer and site (a prefill chunk, then one row per decode step);
    rows are appended along the token dimension.

    Identity (what the record belongs to; see identity.py): `token_ids` (the sample's ids; the first
    T are digested at build, so prompt + all generated ids may be passed) or a precomputed
    `token_digest` of exactly the T ids; `weights_version`, `weights_digest` of the engine's expert
    weights; `num_prompt_tokens`. All optional, set here or with `set_identity` before `build`.
    """

    def __init__(self, shape: ModelShape, config: TraceConfig, *, token_ids=None, token_digest: str | None = None,
                 weights_version=None, weights_digest: str | None = None, num_prompt_tokens: int | None = None):
        self.shape = shape
        self.config = config
        self._identity: dict = {}
        self.set_identity(token_ids=token_ids, token_digest=token_digest, weights_version=weights_version,
                          weights_digest=weights_digest, num_prompt_tokens=num_prompt_tokens)
        self._rows: dict[tuple[int, str], list[NVFP4Tensor]] = {}
        self._routing: dict[int, list[torch.Tensor]] = {}

    def set_identity(self, *, token_ids=None, token_digest: str | None = None, weights_version=None,
                     weights_digest: str | None = None, num_prompt_tokens: int | None = None) -> None:
        """Set identity fields (None leaves a field as it is)."""
        if token_ids is not None and token_digest is not None:
            raise ValueError("pass token_ids or token_digest, not both")
        if token_ids is not None:
            self._identity.pop("token_digest", None)
        if token_digest is not None:
            self._identity.pop("token_ids", None)
        for k, v in (("token_ids", token_ids), ("token_digest", token_digest), ("weights_version", weights_version),
                     ("weights_digest", weights_digest), ("num_prompt_tokens", num_prompt_tokens)):
            if v is not None:
                self._identity[k] = v

    def _build_identity(self, T: int) -> RecordIdentity:
        ident = dict(self._identity)
        ids = ident.pop("token_ids", None)
        if ids is not None:
            n = num_ids(ids)
            if n not in (T, T + 1):
                raise ValueError(f"{n} token ids for a record of {T} token rows (expected {T}, or {T + 1} with the last sampled token)")
            ident["token_digest"] = token_digest(ids[:T])
        P = ident.get("num_prompt_tokens")
        if P is not None and not 0 <= P <= T:
            raise ValueError(f"num_prompt_tokens={P} outside [0, {T}]")
        return RecordIdentity(num_tokens=T, **ident)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.shape.num_layers:
            raise ValueError(f"layer {layer} out of range for a model of {self.shape.num_layers} layers")

    def add(self, layer: int, site: str, q: NVFP4Tensor) -> None:
        self._check_layer(layer)
        row = self.shape.row_shape(site)
        if site not in self.shape.layer_sites(layer):
            raise ValueError(f"layer {layer} has no site {site} (its sites: {self.shape.layer_sites(layer)})")
        if tuple(q.shape[1:]) != row:
            raise ValueError(f"layer {layer}, site {site}: rows of shape {tuple(q.shape[1:])}, expected {row}")
        lead = q.shape[:-1]
        amax = q.global_amax.to(torch.float32)
        amax = amax.reshape(1).expand(lead) if amax.numel() == 1 else amax.reshape(lead)
        self._rows.setdefault((layer, site), []).append(NVFP4Tensor(q.codes, q.scales, amax))

    def add_routing(self, layer: int, expert_ids: torch.Tensor) -> None:
        self._check_layer(layer)
        if not self.shape.has_moe(layer):
            raise ValueError(f"layer {layer} has no routed experts (a dense layer): no routing ids to add")
        if expert_ids.dim() != 2 or expert_ids.shape[1] != self.shape.top_k:
            raise ValueError(f"layer {layer}: routing ids of shape {tuple(expert_ids.shape)}, expected [T, {self.shape.top_k}]")
        if expert_ids.numel() and not (0 <= int(expert_ids.min()) and int(expert_ids.max()) < self.shape.num_experts):
            raise ValueError(f"layer {layer}: routing ids outside [0, {self.shape.num_experts})")
        self._routing.setdefault(layer, []).append(expert_ids.to(torch.int16))

    def num_tokens(self) -> int:
        """Rows so far: the first MoE layer's routing ids (every token goes through it)."""
        first = self.shape.moe_layer_list()[0]
        return sum(ids.shape[0] for ids in self._routing.get(first, []))

    def build(self, config: TraceConfig | None = None) -> GuidanceRecord:
        """Encode with `config` (default: the builder's) deciding each layer's guidance mode."""
        config = config or self.config
        modes = config.layer_modes(self.shape.num_layers)
        T = self.num_tokens()
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(self.shape.num_layers):
            if self.shape.has_moe(layer):
                ids = self._routing.get(layer)
                if not ids:
                    raise ValueError(f"layer {layer}: no routing ids were captured")
                ids = torch.cat(ids).cpu()
                if modes[layer] == "sparse":
                    tensors[_packed_routing_name(layer)] = _pack_routing(ids, self.shape.num_experts)
                else:
                    tensors[_routing_name(layer)] = ids
            if modes[layer] is None:
                continue
            for site in self.shape.layer_sites(layer):
                parts = self._rows.get((layer, site))
                if not parts:
                    raise ValueError(f"layer {layer}, site {site}: guided ({modes[layer]}) but nothing was captured")
                q = NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]).cpu() for f in ("codes", "scales", "global_amax")))
                if modes[layer] == "sparse":
                    tensors[_name(layer, site, "sparse")] = _sparse_payload(q, site)
                    continue
                if modes[layer] == "full":
                    tensors[_name(layer, site, "codes")] = q.codes
                else:
                    tensors[_name(layer, site, "mbits")] = compact(q).mbits
                tensors[_name(layer, site, "scales")] = q.scales
                tensors[_name(layer, site, "amax")] = q.global_amax
        for name, t in tensors.items():
            if name.endswith((".sparse", ".routed_packed")):
                continue  # flat payloads; their row counts are checked when decoded
            if t.shape[0] != T:
                raise ValueError(
                    f"{_where(name)}: {t.shape[0]} token rows, but layer {self.shape.moe_layer_list()[0]}'s routing has {T}"
                )
        return GuidanceRecord(self.shape, config, T, modes, tensors, self._build_identity(T))
