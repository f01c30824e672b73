"""Guide encodings: what a record holds for one layer and site, and what the trainer makes of it.

base.py is the interface; full.py, compact.py and sparse/ are the encodings (the full encoding's
storage is trace_kernels.NVFP4Tensor). The one table from encoding name to type is the record reader's.
"""

from .base import Guide

__all__ = ["Guide"]
