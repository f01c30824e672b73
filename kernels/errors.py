"""The errors trace_kernels raises about guidance data, in one module that everything else can import.

Kept apart from the modules that raise them so that records, identity and the sparse codec never import
each other just to name an error.
"""


class RecordError(ValueError):
    """A guidance record that cannot be used: damaged, or made for another model or config."""


class SparseError(ValueError):
    """A sparse payload that cannot be decoded (damaged, wrong version or shape)."""
