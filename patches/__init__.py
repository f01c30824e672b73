"""trace_fp4_patches: version-checked changes to code trace-fp4 does not own (see README.md)."""
