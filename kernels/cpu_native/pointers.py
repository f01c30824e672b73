"""Integer addresses as typed pointers inside a kernel (for numba.carray): a kernel handed a tensor's
data_ptr() and shape views it without the Python objects a `.numpy()` view costs per call (~1-2 us each
in the engine's per-layer calls). The caller keeps the tensor alive and contiguous (or passes its strides)
for the call; the kernel reads exactly the elements the shape says."""

from numba.core import types
from numba.extending import intrinsic


def _pointer_intrinsic(dtype):
    @intrinsic
    def pointer(typingctx, address):
        """The integer `address` as a pointer to `dtype` elements."""
        if not isinstance(address, types.Integer):
            return None
        sig = types.CPointer(dtype)(address)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return pointer


int16_pointer = _pointer_intrinsic(types.int16)
uint16_pointer = _pointer_intrinsic(types.uint16)
int32_pointer = _pointer_intrinsic(types.int32)
int64_pointer = _pointer_intrinsic(types.int64)
float32_pointer = _pointer_intrinsic(types.float32)
uint8_pointer = _pointer_intrinsic(types.uint8)
