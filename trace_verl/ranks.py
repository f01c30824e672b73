"""Which trainer rank acts for its model-parallel group (deletes the step's records from the store)."""


def model_parallel_rank0() -> bool:
    """True on the rank with TP = PP = CP = EP rank 0 (and where Megatron's groups are not set up)."""
    try:
        from megatron.core import parallel_state as mpu

        return (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_pipeline_model_parallel_rank() == 0
                and mpu.get_context_parallel_rank() == 0 and mpu.get_expert_model_parallel_rank() == 0)
    except (AssertionError, RuntimeError):
        return True
