"""Which tensors a record holds: their names, and the one table from a layer's encoding name (the
record's `layer_modes`) to its Guide type."""

import torch

from ..guides.compact import CompactGuide
from ..guides.sparse import SparseGuide
from ..model_shape import ModelShape
from ..tensor import NVFP4Tensor
from .routing import packed_nbytes

GUIDE_TYPES = {"full": NVFP4Tensor, "compact": CompactGuide, "sparse": SparseGuide}
ENCODINGS = tuple(GUIDE_TYPES)


def guide_type(mode: str | None):
    """The Guide type of a layer's encoding name; None for a layer without guidance."""
    return None if mode is None else GUIDE_TYPES[mode]


def tensor_name(layer: int, site: str, part: str) -> str:
    return f"layer.{layer}.{site}.{part}"


def routing_name(layer: int, packed: bool) -> str:
    return f"layer.{layer}.routed_packed" if packed else f"layer.{layer}.routed_experts"


def packs_routing(mode: str | None) -> bool:
    kind = guide_type(mode)
    return kind is not None and kind.packed_routing


def site_rows(shape: ModelShape, T: int, site: str) -> tuple[tuple[int, ...], int]:
    """(leading shape, K) of T tokens' rows at `site`."""
    row = shape.row_shape(site)
    return (T, *row[:-1]), row[-1]


def expected_tensors(shape: ModelShape, T: int, modes) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
    """Every tensor a record of T tokens with these layer modes holds: name -> (shape, or None for a flat
    payload whose length is checked when it is decoded; dtype)."""
    out = {}
    for layer, mode in enumerate(modes):
        kind = guide_type(mode)
        if shape.has_moe(layer):
            if packs_routing(mode):
                out[routing_name(layer, True)] = ((packed_nbytes(T, shape.top_k, shape.num_experts),), torch.uint8)
            else:
                out[routing_name(layer, False)] = ((T, shape.top_k), torch.int16)
        if kind is None:
            continue
        for site in shape.layer_sites(layer):
            for part, spec in kind.record_layout(*site_rows(shape, T, site)).items():
                out[tensor_name(layer, site, part)] = spec
    return out


def where(name: str) -> str:
    """A tensor name in words, for refusals: "layer 3, site k" or "layer 3, routing ids"."""
    parts = name.split(".")
    return f"layer {parts[1]}" + (f", site {parts[2]}" if len(parts) > 3 else ", routing ids")
