import os
import sys

from hypothesis import HealthCheck, settings

# Test helpers (oracle, adversarial data, engine helpers) are plain modules beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "trace", deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("trace")


import pytest  # noqa: E402


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
