"""TEST-ONLY stand-in for `torchvision` (the PyPI wheel is a CUDA build that fails to import next to
torch's CPU wheel). SGLang and transformers import a few names at module level for multimodal models;
the tiny text-only test model never calls them. Anything that does call them raises.
"""

__version__ = "0.0.0+trace_fp4_test_stub"


def _unavailable(*args, **kwargs):
    raise RuntimeError(
        "torchvision is a test stub here (tests/helpers/sglang_stubs): multimodal paths are not available"
    )
