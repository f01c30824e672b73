"""trace_fp4: the jobs around the packages: `trace-fp4 align`, the embedded tiny model, the HF ->
Megatron-Core converter, and Megatron-Core's CPU mode."""
