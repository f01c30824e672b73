"""What every test shares: the hypothesis profile, the `engine` / `slow` markers, Megatron's process group.

The helper modules in tests/helpers (the NVFP4 oracle, adversarial data, engine drivers, the record
factory) import by their bare names, `from vllm_helpers import ...`: pyproject.toml's pytest `pythonpath`
puts that folder on sys.path.
"""

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "trace", deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("trace")

TESTS = Path(__file__).resolve().parent

# Tests that start a vLLM or SGLang engine (in this process, in a child process, or through the
# `trace-fp4 align` command) or a Ray cluster. An entry is a module (all its tests) or
# `module::test_function` (all its parametrizations). Listed here rather than in the modules so that the
# fast tier (`make test-fast`, no engine start, 3 minutes on 2 cores) is one list to audit: a new test
# that starts an engine must be added.
ENGINE = {
    "kernels/test_record_stores.py::test_ray_store",
    "vllm/test_vllm_async.py",
    "vllm/test_vllm_partial_rollout.py",
    "vllm/test_vllm_bf16_layers.py",
    "vllm/test_vllm_compile.py",
    "vllm/test_vllm_config.py",
    "vllm/test_vllm_errors.py",
    "vllm/test_vllm_generate.py",
    "vllm/test_vllm_graph_capture.py",
    "vllm/test_vllm_kv_packed.py",
    "vllm/test_vllm_cpu_native.py",
    "vllm/test_vllm_take_kernels_at_load.py",
    "vllm/test_vllm_multiproc.py",
    "vllm/test_vllm_tensor_parallel.py",
    "vllm/test_vllm_record_travel.py",
    "vllm/test_vllm_weight_update.py",
    "sglang/test_sglang_bf16_layers.py",
    "sglang/test_sglang_capture.py",
    "sglang/test_sglang_errors.py::test_unknown_quantization_config_key_fails_at_start",
    "sglang/test_sglang_errors.py::test_dense_model_is_refused_at_start",
    "sglang/test_sglang_errors.py::test_config_naming_layers_the_model_lacks_is_refused_at_start",
    "sglang/test_sglang_kv_packed.py",
    "sglang/test_sglang_vllm_parity.py",
    "sglang/test_sglang_weight_update.py",
    "sglang/test_sglang_tensor_parallel.py::test_one_record_per_request_in_the_single_rank_layout",
    "sglang/test_sglang_tensor_parallel.py::test_weights_digest_covers_both_ranks_and_equals_a_single_rank_load",
    "sglang/test_sglang_tensor_parallel.py::test_a_single_rank_trainer_guided_by_tp2_records_has_no_mismatch",
    "sglang/test_static_scales.py",
    "verl/test_verl_e2e.py",
    "slime/test_slime_e2e.py",
    "verl/test_verl_agent_loop.py",
    "verl/test_verl_fully_async.py",
    "verl/test_verl_one_step_off_policy.py",
    "jobs/test_align_turns.py",
    "jobs/test_align_e2e.py::test_full_guidance_leaves_no_reachable_mismatch",
    "jobs/test_align_e2e.py::test_the_trainer_computes_the_engines_fc2_inputs_bit_for_bit",
    "jobs/test_align_e2e.py::test_compact_removes_rtn_mismatches_in_the_layers_it_guides",
    "jobs/test_align_e2e.py::test_trace_logprob_gap_is_below_plain_fp4",
    "jobs/test_align_e2e.py::test_gap_figures_match_a_computation_from_the_raw_logprobs",
    "jobs/test_align_e2e.py::test_guidance_bytes_match_the_record_layout",
    "jobs/test_align_e2e.py::test_json_holds_every_figure_of_the_table",
    "jobs/test_align_e2e.py::test_sparse_guidance_is_small_and_counts_what_it_cannot_resolve",
    "jobs/test_align_e2e.py::test_align_with_sglang",
    "jobs/test_rl_miniature.py",
    "jobs/test_export_loaders.py::test_vllm_cpu_takes_the_checkpoint_up_to_its_nvfp4_moe_kernel",
    "archs/test_align_deepseek.py",
    "archs/test_align_glm.py",
    "archs/test_align_gpt_oss.py",
    "archs/test_align_mixtral.py",
    "archs/test_deepseek_v3_capture.py",
    "archs/test_deepseek_v3_vllm.py::test_patched_generation_matches_transformers",
    "archs/test_deepseek_v3_vllm.py::test_moe_layer_routing_and_scaling",
    "archs/test_qwen3_next_vllm.py",
    "archs/test_qwen3_next_vllm_multiproc.py",
    "archs/test_sglang_glm_mixtral.py",
    "archs/test_vllm_glm_mixtral.py",
    "archs/test_vllm_gpt_oss.py",
    "archs/test_vllm_gpt_oss_kv_read.py",
}

# Tests over ~20 s on 2 CPU cores for another reason than an engine start (measured with --durations=0).
SLOW = {
    # The compiled CPU path: inductor compiles each piece on first use (seconds each, cached on disk).
    "kernels/test_cpu_compiled.py",
    # The grouped GEMM interpreted by Triton under a TorchDispatchMode: 1-4 s by the machine's load.
    "kernels/test_no_host_sync.py::test_moe_with_capture_on_triton_has_no_host_sync",
    # The packed-KV decode attention interpreted by Triton (6 programs, 3 blocks each): 5-6 s under load.
    "kernels/test_packed_kv_attention.py::test_decode_attention_over_packed_pages_matches_the_reference_without_host_sync",
    "kernels/test_triton_cuda_compile.py",  # every Triton kernel through the CUDA compiler (LLVM, ptxas): 15-30 s
    "jobs/test_rl_miniature.py",  # GRPO steps of every arm
    "jobs/test_export_loaders.py",  # imports compressed-tensors and vLLM; a child imports SGLang
    "megatron/test_megatron_bf16_layers.py",  # five tiny GPTModels, forward each
    "jobs/test_align_e2e.py::test_sglang_without_sgl_kernel_is_refused_clearly",  # the child imports SGLang
    # Two spawned ranks, each importing torch and Megatron-Core: 10-21 s, by the machine's load.
    "megatron/test_megatron_expert_parallel.py",
    "megatron/test_megatron_pipeline_parallel.py",
    "megatron/test_megatron_tensor_parallel.py",
    "megatron/test_megatron_context_parallel.py::test_packed_sequences_match_verls_cp_packing",  # imports verl
    "megatron/test_megatron_layout_agreement_parallel.py",  # two spawned ranks, BF16 and guided models
    "megatron/test_megatron_context_parallel_training.py",  # two spawned CP ranks, forward and backward
    "jobs/test_trainer_layout.py",  # the align job's trainer layouts: 2 spawned ranks each, 9-15 s per layout
    "vllm/test_replicas_parallel.py",  # two spawned replica processes
    "vllm/test_vllm_graph_capture_bench.py::test_gpu_check_dry_run_checks_and_prints_its_plan",  # imports vLLM's config
    # Megatron and transformers gpt-oss side by side in fp32: 13-25 s, by the machine's load.
    "archs/test_gpt_oss_megatron.py::test_logits_match_transformers_in_fp32",
    "archs/test_gpt_oss_megatron.py::test_window_matters",  # the same two models, windowed and not: 20-25 s
    # three Megatron forwards with sparse decodes under heavy engine noise (wide searches): 3-10 s
    "megatron/test_megatron_sparse_rates.py",
    # the torch reference's wide searches at 3-10% noise, beside the native decode: 15-30 s under load
    "kernels/test_cpu_native_sparse_decode.py::test_whole_decodes_beyond_the_design_equal_the_reference",
    "kernels/test_cpu_native_sparse_decode.py::test_search_equals_the_staged_and_wide_reference_search",
    # (compiles and runs the decode at four code-bit rates, ~30 s on a fresh clone)
    "kernels/test_cpu_native_sparse_decode.py::test_the_wide_search_widens_with_the_code_bits_as_the_reference_does",
    # exp16 against libm's expf on all 2^32 float32 inputs: ~40 s on one core
    "kernels/test_cpu_native_attention_exp.py::test_equals_the_scalar_expf_on_every_float32",
    # (three subprocesses that each compile kernels into a fresh cache, ~10 s)
    "kernels/test_cpu_native_cache.py",
}


def pytest_configure(config):
    """A renamed or removed module would silently drop out of the lists: refuse names that match no file."""
    for entry in sorted(ENGINE | SLOW):
        module = entry.partition("::")[0]
        if not (TESTS / module).is_file():
            raise pytest.UsageError(f"tests/conftest.py lists {entry!r}, but tests/{module} does not exist")


def _listed(item, entries: set[str]) -> bool:
    module = item.path.relative_to(TESTS).as_posix()
    return module in entries or f"{module}::{item.originalname}" in entries


def pytest_collection_modifyitems(config, items):
    modules = {item.path.relative_to(TESTS).as_posix(): item.module for item in items}
    for entry in sorted(ENGINE | SLOW):
        module, _, test = entry.partition("::")
        if test and module in modules and not hasattr(modules[module], test):
            raise pytest.UsageError(f"tests/conftest.py lists {entry!r}, but tests/{module} has no {test}")
    for item in items:
        if _listed(item, ENGINE):
            item.add_marker(pytest.mark.engine)
        if _listed(item, SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _megatron_process_group(request):
    """Megatron test modules set up a gloo process group, Megatron's parallel state and the CPU
    redirections when imported (at collection). A vLLM engine run in-process by an earlier test
    destroys torch.distributed's default group when it shuts down (`cleanup_dist_env_and_memory`) and
    replaces torch.cuda's stream stand-ins with its own: put both back for the modules that use them."""
    helpers = sys.modules.get("megatron_cpu")
    if helpers is not None and any(v is helpers for v in vars(request.module).values()):
        import torch.distributed

        from trace_fp4 import megatron_cpu

        megatron_cpu.install()
        if not torch.distributed.is_initialized():
            helpers.init_parallel()
    yield
