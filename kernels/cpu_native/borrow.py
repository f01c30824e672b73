"""`borrow(a)`: a view of a numba array without a reference count, for the hot call chains of a kernel.

Why: numba pays an atomic NRT_incref / NRT_decref on an array's meminfo for every array argument of every
njit call and every local it is bound to. The sparse decode calls its per-row and per-segment helpers with
5-20 arrays each, thousands of times per site: under perf those atomics were ~20-37% of a one-thread
decode, and on two threads both workers bump the same counters (the site's shared inputs), so the
cache line bounces between cores. A borrowed view is the same array (data, shape, strides) with a NULL
meminfo: NRT_incref / NRT_decref return at their null check, no atomic and no shared write.

The contract: a borrowed view must not outlive the array it was taken from. A kernel's arguments live for
the whole call (the caller holds them); an array the kernel allocates itself must stay bound to a live
variable until the last use of its views (numba frees an array after its variable's last use: `keep`).
Never return a borrowed view or store it in a container that outlives the call.
"""

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def borrow(typingctx, arr):
    """The array `arr` with its meminfo set to NULL (no reference counting on it or on its copies)."""
    if not isinstance(arr, types.Array):
        raise TypeError(f"borrow takes an array, got {arr}")

    def codegen(context, builder, sig, args):
        view = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        return view._getvalue()  # a new "reference" with no meminfo: the caller's decref of it is a no-op

    return arr(arr), codegen


@intrinsic
def keep(typingctx, arr):
    """A use of `arr` that does nothing: placed after the last use of its borrowed views, it keeps numba
    from freeing the array before then."""
    if not isinstance(arr, types.Array):
        raise TypeError(f"keep takes an array, got {arr}")

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.none(arr), codegen
