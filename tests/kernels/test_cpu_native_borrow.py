"""kernels/cpu_native/borrow.py: a borrowed view is the same array without a reference count (reads and
writes go to the original's memory, views of it too), helpers called with it see the same data, and
anything but an array is refused at compile time."""

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from trace_kernels.cpu_native.borrow import borrow, keep  # noqa: E402


@numba.njit
def _add_one(a):  # a helper taking the borrowed view as an argument, as the decode's helpers do
    for i in range(a.shape[0]):
        a[i] += 1


@numba.njit
def _through_borrow(a, b):
    v = borrow(a)
    _add_one(v)
    bits = v.view(np.int32)  # a view of a borrowed view writes the original too
    bits[0] = np.int32(0x40E00000)  # 7.0f
    own = np.zeros(4, np.float32)  # a kernel's own array, kept alive past its view's last use
    w = borrow(own)
    for i in range(4):
        w[i] = b[i] * 2
    s = np.float32(0.0)
    for i in range(4):
        s += w[i]
    keep(own)
    return s


def test_borrowed_view_reads_and_writes_the_original():
    a = np.arange(6, dtype=np.float32)
    b = np.arange(4, dtype=np.float32)
    s = _through_borrow(a, b)
    assert a.tolist() == [7.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert s == np.float32(12.0)


def test_borrow_refuses_what_is_not_an_array():
    @numba.njit
    def f(x):
        return borrow(x)

    with pytest.raises(TypeError, match="borrow takes an array"):
        f(3)
