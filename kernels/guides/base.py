"""The Guide interface: what the trainer rounds toward, whatever encoding the record chose.

A guide holds rows `[..., K]` of one layer and site as three per-row tensors (`fields()`, leading
dimensions = the rows), so selecting, concatenating, slot-gathering and shipping rows through the token
dispatcher is one piece of code for every encoding. Each encoding (full.py, compact.py, sparse/) says
what its fields hold, how they sit in a record and in a per-row byte payload, and what the trainer's
own values resolve to. Storage is the dataclass of each encoding; the behaviour is written against
`fields()` here, as TransformerEngine splits a quantized tensor's storage from its behaviour.
"""

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


def _row_bytes(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, ...] -> uint8 [n, row bytes]; widths are explicit so that n == 0 keeps its shape."""
    return t.contiguous().view(torch.uint8).reshape(n, math.prod(t.shape[1:]) * t.element_size())


def _bytes_as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret byte columns as `dtype`. A copy, because a column slice can be contiguous (one row) yet
    start at an offset that is not a multiple of the element size."""
    return columns.clone(memory_format=torch.contiguous_format).view(dtype)


class Guide(ABC):
    """Guidance rows of one layer and site. Subclasses are frozen dataclasses of three per-row tensors."""

    encoding: ClassVar[str]  # the name a record's `layer_modes` gives this encoding
    # What a layer recorded in this encoding can be re-encoded into (None: unguided, routing only).
    # Detail that was not recorded cannot come back.
    serves: ClassVar[tuple[str | None, ...]]
    packed_routing: ClassVar[bool] = False  # the record bit-packs the layer's routing ids
    whole_rows: ClassVar[bool] = False  # the fields describe whole rows: they cannot be split by column

    # ---- storage --------------------------------------------------------------------------------
    @abstractmethod
    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three per-row tensors, in the dataclass's order."""

    @classmethod
    @abstractmethod
    def row_fields(cls, K: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Per row of K elements: the trailing shape and dtype of each field."""

    @property
    def shape(self) -> torch.Size:
        """Shape of the values these rows guide, `[..., K]`."""
        scales = self.fields()[1]  # one byte per 16-element block in every encoding
        return torch.Size((*scales.shape[:-1], scales.shape[-1] * 16))

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes these rows take in a record."""

    # ---- rows -----------------------------------------------------------------------------------
    def map_rows(self, fn) -> "Guide":
        """The same encoding with `fn` applied to every field (fn works on the leading, row dimensions)."""
        return type(self)(*(fn(t) for t in self.fields()))

    def __getitem__(self, index) -> "Guide":
        return self.map_rows(lambda t: t[index])

    def to(self, device) -> "Guide":
        return self.map_rows(lambda t: t.to(device))

    @classmethod
    def cat(cls, parts: list["Guide"]) -> "Guide":
        """Rows of several guides of this encoding, one after the other."""
        return cls(*(torch.cat(ts) for ts in zip(*(p.fields() for p in parts))))

    def column_shard(self, rank: int, size: int) -> "Guide":
        """The `rank`-th of `size` equal column shards (K split in whole 16-blocks)."""
        if self.whole_rows:
            raise NotImplementedError(f"{self.encoding} guidance rows cover whole rows: they cannot be split by column")
        data, scales, amax = self.fields()
        nd, ns = data.shape[-1] // size, scales.shape[-1] // size
        return type(self)(data[..., rank * nd : (rank + 1) * nd], scales[..., rank * ns : (rank + 1) * ns], amax)

    # ---- one byte row per guide row (what travels through Megatron's token dispatcher) ------------
    @classmethod
    def row_nbytes(cls, K: int) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in cls.row_fields(K))

    def to_row_bytes(self, n: int) -> torch.Tensor:
        """uint8 [n, row_nbytes(K)] of guide rows [n, K]."""
        return torch.cat([_row_bytes(t, n) for t in self.fields()], dim=1)

    @classmethod
    def from_row_bytes(cls, b: torch.Tensor, K: int, lead: tuple) -> "Guide":
        """Inverse of `to_row_bytes` for rows of leading shape `lead`."""
        out, off = [], 0
        for shape, dtype in cls.row_fields(K):
            width = math.prod(shape) * dtype.itemsize
            out.append(_bytes_as(b[:, off : off + width], dtype).reshape(*lead, *shape))
            off += width
        return cls(*out)

    # ---- records ----------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def record_layout(cls, lead: tuple, K: int) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
        """Record tensor parts of rows `lead` x K: part name -> (shape, or None for a flat payload whose
        length is checked when it is decoded; dtype)."""

    @abstractmethod
    def record_parts(self) -> dict[str, torch.Tensor]:
        """The record tensors of these rows, by part name (`layer.<i>.<site>.<part>` in the file)."""

    @classmethod
    @abstractmethod
    def from_record_parts(cls, parts: dict[str, torch.Tensor], lead: tuple, K: int) -> "Guide":
        """Rows `lead` x K from the record tensors `record_parts` wrote."""

    @classmethod
    @abstractmethod
    def encode(cls, rows: "Guide", site: str) -> "Guide":
        """These rows in this encoding, from the rollout's rows of `site` (an encoding that serves it)."""

    # ---- the trainer ----------------------------------------------------------------------------
    @abstractmethod
    def rounding_target(self, x: torch.Tensor, *, block_scale: str = "6"):
        """(guide, report) for guided rounding of the trainer's values `x` (shape `self.shape`): the guide
        is what the rounding kernels take (an NVFP4Tensor or a CompactGuide); report counts what a
        decode could not resolve (None when nothing is decoded)."""

    def round_rows(self, x2: torch.Tensor, amax: torch.Tensor, *, use_triton: bool, out_dtype, capture: bool,
                   block_scale: str = "6"):
        """Guided rounding of the trainer's rows x2 `[R, K]` (float32 amax `[R]` per row) toward these rows,
        with their scales: (codes, scales, dequantized out or None). Only the encodings the rounding
        kernels take as they are (full, compact) round directly; any other hands over its
        `rounding_target` first, which `trace_kernels.quantize_guided` does for every guide."""
        raise TypeError(f"{self.encoding} guidance is rounded through its rounding_target (decode it first)")

    @abstractmethod
    def mismatches(self, q) -> int:
        """Elements of the NVFP4Tensor `q` (same shape) that disagree with these rows."""
