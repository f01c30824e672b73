"""A TorchDispatchMode that fails on the ops a CUDA graph cannot hold: a host synchronisation
(`aten._local_scalar_dense`: `.item()`, `.tolist()`, `bool(tensor)`, `int(tensor)`) or an output whose
shape depends on the data (`nonzero`, `masked_select`, `unique`, `repeat_interleave` without an output
size). Run code under it on a CPU to show that its device path could be captured in a CUDA graph."""

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

FORBIDDEN = {
    aten._local_scalar_dense: "a host synchronisation (.item() / .tolist() / bool(tensor))",
    aten.nonzero: "a data-dependent shape (nonzero, also boolean-mask indexing)",
    aten.masked_select: "a data-dependent shape (masked_select)",
    aten._unique: "a data-dependent shape (unique)",
    aten._unique2: "a data-dependent shape (unique)",
    aten.unique_dim: "a data-dependent shape (unique)",
    aten.unique_consecutive: "a data-dependent shape (unique_consecutive)",
    aten.repeat_interleave: "a data-dependent shape (repeat_interleave)",
}


# Indexing with a boolean mask (`t[mask]`, `t[mask] = v`): the result's shape depends on the data.
MASK_INDEXING = {aten.index, aten.index_put, aten._index_put_impl_}


def _mask_index(func, args) -> bool:
    if func.overloadpacket not in MASK_INDEXING or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())


class HostSyncError(AssertionError):
    pass


# Functions with a CPU-only branch that reads a value on the host (input validation) and a device
# branch that does not (`trace_kernels.backend.check_amax_sign`: `torch._assert_async` on CUDA). A
# forbidden op called from one of them on a CPU tensor is what the CPU branch does, so it is allowed.
CPU_ONLY_CHECKS = {"check_amax_sign"}


def _inside_cpu_only_check() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in CPU_ONLY_CHECKS:
            return True
        frame = frame.f_back
    return False


class NoHostSync(TorchDispatchMode):
    """Raises HostSyncError on the first forbidden op; `ops` counts every op seen (proof it ran),
    `allowed` the forbidden ops let through inside CPU-only checks."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.allowed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        why = FORBIDDEN.get(func.overloadpacket)
        if why is None and _mask_index(func, args):
            why = "a data-dependent shape (boolean-mask indexing)"
        if why is not None:
            if _inside_cpu_only_check():
                self.allowed += 1
            else:
                raise HostSyncError(f"{func}: {why}")
        return func(*args, **(kwargs or {}))
