"""Guidance records: the record (record.py), how it is built (builder.py), which tensors it holds
(layout.py, routing.py) and how it is checked (integrity.py)."""

from ..errors import RecordError
from ..model_shape import ModelShape
from .builder import RecordBuilder
from .integrity import (
    FORMAT_NAME, FORMAT_VERSION, READABLE_VERSIONS, canonical_header, metadata_digest, read_metadata,
)
from .layout import ENCODINGS, GUIDE_TYPES
from .record import GuidanceRecord

# The record stores (stores/prefix.py) rewrite headers with the same canonical form.
_canonical_header = canonical_header

__all__ = [
    "ENCODINGS", "FORMAT_NAME", "FORMAT_VERSION", "GUIDE_TYPES", "GuidanceRecord", "ModelShape", "READABLE_VERSIONS",
    "RecordBuilder", "RecordError", "canonical_header", "metadata_digest", "read_metadata",
]
