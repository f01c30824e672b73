"""A layer's site in a record's encoding, with what the config adds for sparse guidance: the rates of
that layer and site (config.sparse_rates) and the audit (the full rows of a sample of tokens)."""

import torch

from .. import envs
from ..guides.sparse import SparseGuide
from ..guides.sparse.audit import PARTS as AUDIT_PARTS
from ..guides.sparse.audit import audit_parts, audit_rows
from ..guides.sparse.fused_encode import encode_payload
from ..guides.sparse.rates import layer_rates
from ..tensor import NVFP4Tensor


def encode_site(kind, rows, config, layer: int, site: str, token_digest: str | None) -> dict[str, torch.Tensor]:
    """Record tensors (part name -> tensor) of `rows` ([T, *row], the rollout's) in encoding `kind`."""
    if kind is not SparseGuide:
        return kind.encode(rows, site).record_parts()
    K = rows.shape[-1]
    parts = {"sparse": encode_payload(rows, site, layer_rates(config, layer, site, K), backend=record_backend(rows))}
    # Only full rows can be audited (a compact record has no codes to send): such a re-encode has no audit.
    if config.sparse_audit > 0 and isinstance(rows, NVFP4Tensor):
        chosen = audit_rows(rows.shape[0], layer, site, config.sparse_audit, token_digest)
        parts.update(audit_parts(rows, chosen))
    return parts


def record_backend(rows) -> str:
    """The sparse encoder's backend for a record's rows: TRACE_FP4_RECORD_BACKEND ("auto" follows
    TRACE_FP4_CPU_BACKEND, "native" the numba encoder on CPU rows, "eager" the torch reference)."""
    choice = envs.TRACE_FP4_RECORD_BACKEND
    if choice == "auto" or rows.scales.device.type != "cpu":
        return "auto"
    return "native" if choice == "native" else "torch"


def is_audit_part(name: str) -> bool:
    """Whether a record tensor name (`layer.<i>.<site>.<part>`) is an audit part (optional tensors)."""
    return name.rsplit(".", 1)[-1] in AUDIT_PARTS
