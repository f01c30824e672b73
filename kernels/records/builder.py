"""RecordBuilder: collects one sample's captured NVFP4 rows, in token order, and encodes a GuidanceRecord."""

import torch

from ..config import TraceConfig
from ..identity import RecordIdentity, num_ids, token_digest
from ..model_shape import ModelShape
from ..tensor import NVFP4Tensor
from .layout import guide_type, packs_routing, routing_name, site_rows, tensor_name, where
from .record import GuidanceRecord
from ..guides.sparse import SparseGuide
from .sparse_parts import encode_site
from .routing import pack_routing


def _joined(parts: list, read_only: bool) -> torch.Tensor:
    """The parts concatenated on the host. With `read_only` (the sparse encoder: its record tensors are
    new ones, it only reads the rows), one contiguous host part is used as it is: the engines add each
    site's rows already joined (one part), and copying them again cost 48 copies per record. Other
    encodings may put the rows themselves in the record, which must not alias the caller's storage."""
    if read_only and len(parts) == 1 and parts[0].device.type == "cpu" and parts[0].is_contiguous():
        return parts[0]
    return torch.cat(parts).cpu()


class RecordBuilder:
    """Collects one sample's captured NVFP4 rows, in token order, then encodes a GuidanceRecord.

    `add` may be called many times per layer and site (a prefill chunk, then one row per decode step);
    rows are appended along the token dimension.

    Identity (what the record belongs to; see trace_kernels.identity): `token_ids` (the sample's ids; the first
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
                     weights_digest: str | None = None, num_prompt_tokens: int | None = None,
                     version_ranges=None) -> None:
        """Set identity fields (None leaves a field as it is)."""
        if token_ids is not None and token_digest is not None:
            raise ValueError("pass token_ids or token_digest, not both")
        if token_ids is not None:
            self._identity.pop("token_digest", None)
        if token_digest is not None:
            self._identity.pop("token_ids", None)
        for k, v in (("token_ids", token_ids), ("token_digest", token_digest), ("weights_version", weights_version),
                     ("weights_digest", weights_digest), ("num_prompt_tokens", num_prompt_tokens),
                     ("version_ranges", version_ranges)):
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
        identity = self._build_identity(T)
        tensors: dict[str, torch.Tensor] = {}
        per_token: list[str] = []  # tensors with one row per token (flat payloads are checked when decoded)
        for layer in range(self.shape.num_layers):
            kind = guide_type(modes[layer])
            if self.shape.has_moe(layer):
                ids = self._routing.get(layer)
                if not ids:
                    raise ValueError(f"layer {layer}: no routing ids were captured")
                ids = torch.cat(ids).cpu()
                if packs_routing(modes[layer]):
                    tensors[routing_name(layer, True)] = pack_routing(ids, self.shape.num_experts)
                else:
                    tensors[routing_name(layer, False)] = ids
                    per_token.append(routing_name(layer, False))
            if kind is None:
                continue
            for site in self.shape.layer_sites(layer):
                parts = self._rows.get((layer, site))
                if not parts:
                    raise ValueError(f"layer {layer}, site {site}: guided ({modes[layer]}) but nothing was captured")
                q = NVFP4Tensor(*(_joined([getattr(p, f) for p in parts], kind is SparseGuide) for f in ("codes", "scales", "global_amax")))
                layout = kind.record_layout(*site_rows(self.shape, T, site))
                for part, t in encode_site(kind, q, config, layer, site, identity.token_digest).items():
                    tensors[tensor_name(layer, site, part)] = t
                    if part in layout and layout[part][0] is not None:
                        per_token.append(tensor_name(layer, site, part))
        for name in per_token:
            t = tensors[name]
            if t.shape[0] != T:
                raise ValueError(
                    f"{where(name)}: {t.shape[0]} token rows, but layer {self.shape.moe_layer_list()[0]}'s routing has {T}"
                )
        return GuidanceRecord(self.shape, config, T, modes, tensors, identity)
