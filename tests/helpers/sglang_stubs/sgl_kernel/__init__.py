"""TEST-ONLY stand-in for `sgl_kernel` (SGLang's compiled kernel package has no CPU build on PyPI).

SGLang imports `sgl_kernel` at module level in many files. This empty module makes those imports
succeed; it registers no `torch.ops.sgl_kernel.*` op, so SGLang's `cpu_has_amx_support()` is False and
SGLang takes its plain-torch CPU paths. Nothing in trace_sglang_plugin imports it.
"""

__version__ = "0.0.0+trace_fp4_test_stub"


def _make_missing(name):
    def missing(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} called, but sgl_kernel is a test stub (tests/helpers/sglang_stubs)")

    missing.__name__ = name
    return missing


def __getattr__(name):
    # `from sgl_kernel import some_kernel` must import; calling it raises, so a path that really needs
    # a compiled kernel fails loudly instead of silently computing something else.
    if name.startswith("__"):
        raise AttributeError(name)
    return _make_missing(name)
