"""Native routed experts: `trace_kernels.routed_experts.routed_experts` (default block scale) as two
kernel calls around the per-site amax callback, where the torch code is ~40 ops per MoE layer call. The
engine's usual case (silu on bf16, per-row amax, no bias) runs both calls as one (`moe_kernel`), with the
bf16 input and output read and written as bits there: fewer torch ops per call (see moe_kernel).

  call A (`fc1_kernel`): the stable counting sort of the (token, slot) pairs by expert (argsort's
    stable order, offs), fc1 (grouped_mm_kernel: quantize on load, capture of moe_fc1_in by each
    token's slot-0 row, bias), gate/up rounded to bf16, the gated activation, rounded to bf16;
  amax("moe_fc2_in", h) in Python (the engines' site_amax: per row or static, saturation counted);
  call B (`fc2_kernel`): fc2 (capture of moe_fc2_in at each pair's own row, bias), the unsort and the
    routing-weighted sum over slots.

Bit identity with the torch code, piece by piece:
- the activation (silu only, bf16 model dtype): `F.silu` on a bf16-valued float32 takes one of 65,536
  inputs, so it is a table made by torch itself. torch's vector loop (Sleef exp) and its scalar tail
  (libm exp) disagree on ~120 inputs, so there are two tables, and the position in the row picks one:
  torch runs the vector loop over the first I - I % W values of each row of the gate slice and the
  scalar loop over the rest (W is measured once, not assumed). The product with up and the bf16
  rounding (round to nearest even) are single IEEE operations.
- the weighted sum `(down * w).sum(dim=1)`: torch reduces the slot dim of [T, k, H] with its outer-sum
  kernel; for H a multiple of 64 and k <= 16 that is acc = 0, acc += p[0], ..., acc += p[k-1]
  (SumKernel.cpp's multi_row_sum, one level), which the kernel does. Other H or k: torch's sum on the
  unsorted products (counted).
- NaN: a NaN's bits after torch's bf16 cast depend on its position in the batch (see quantize.py), so
  call A stops at the first NaN in gate/up or h and the activation runs torch's code on the fc1 output
  (counted, `routed_experts_nan`). The final cast to the model dtype is torch's `.to`.
Other activations (gelu, gelu_tanh, swigluoai) and model dtypes run torch's activation between the
calls (counted); everything else stays native.
"""

import functools

import numpy as np
import torch
import torch.nn.functional as F
from numba import carray

from . import njit, parallel_launch, torch_for
from .grouped_mm import grouped_mm_kernel, grouped_mm_serial
from .kv_row_write import quantize_bits_kernel, row_amax_bits_kernel
from .pointers import float32_pointer, int16_pointer, int32_pointer, int64_pointer
from ..api import row_amax
from .quantize import CALLS, NUMERATOR, np_view, quantize_kernel, row_amax_kernel, tables

F32 = np.float32


@njit
def sort_pairs(ids, k, E, want_cap, order, offs):
    """The (token, slot) pairs of ids i64 [M = T*k] (flat) stably sorted by expert (a counting sort: argsort's
    stable order) -> order i64 [M], offs i32 [E] cumulative. Returns (status, src, dest): status -1, or the
    index of an expert id outside [0, E) (nothing else then valid); src i64 [M] each sorted row's token;
    dest i64 [M] (want_cap) the capture row of each sorted row, its token for slot 0, else -1."""
    M = ids.shape[0]
    src = np.empty(M, dtype=np.int64)
    dest = np.empty(M if want_cap else 0, dtype=np.int64)
    counts = np.zeros(E, dtype=np.int64)
    for m in range(M):
        e = ids[m]
        if e < 0 or e >= E:
            return m, src, dest
        counts[e] += 1
    pos = np.empty(E, dtype=np.int64)
    run = 0
    for e in range(E):
        pos[e] = run
        run += counts[e]
        offs[e] = np.int32(run)
    for m in range(M):  # in pair order: a counting sort is stable, as argsort(stable=True)
        e = ids[m]
        order[pos[e]] = m
        pos[e] += 1
    for m in range(M):
        src[m] = order[m] // k
        if want_cap:
            dest[m] = src[m] if order[m] % k == 0 else -1
    return -1, src, dest


@njit
def silu_rows(gu, silu_vec, silu_scalar, n_vec, h_bits, h_f32, want_f32):
    """The silu activation of gu f32 [M, 2I] (gate | up) into h_bits u16 [M, I] (bf16) and, with want_f32,
    h_f32 (their float32 values). False if a NaN is in gate / up or in h (the caller then runs torch's
    activation on gu: a NaN's bits are torch's to decide; what was written here is not used).
    Per row in passes the compiler vectorises, on the float32 bits (gu's uint32 view) rather than through
    a one-float buffer per value: gate and up rounded to bf16 (bf16_bits' integer rounding), silu of the
    gate from torch's table of its loop (a gather), the product with up's bf16 value (one float32
    multiply, as torch), and h rounded to bf16."""
    M = gu.shape[0]
    II = h_bits.shape[1]
    gu_u = gu.view(np.uint32)
    gb = np.empty(II, dtype=np.int64)
    u_w = np.empty(II, dtype=np.uint32)  # up's bf16 value, widened (bits << 16)
    u_f = u_w.view(np.float32)
    s_row = np.empty(II, dtype=np.float32)
    h_row = np.empty(II, dtype=np.float32)
    h_u = h_row.view(np.uint32)
    nv = min(n_vec, II)
    for m in range(M):
        bad = 0
        for i in range(II):
            g = np.int64(gu_u[m, i])
            u = np.int64(gu_u[m, II + i])
            bad |= ((g & 0x7FFFFFFF) > 0x7F800000) | ((u & 0x7FFFFFFF) > 0x7F800000)
            gb[i] = ((g + 0x7FFF + ((g >> 16) & 1)) >> 16) & 0xFFFF
            u_w[i] = np.uint32((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF) << 16)
        if bad:
            return False
        for i in range(nv):
            s_row[i] = silu_vec[gb[i]]
        for i in range(nv, II):
            s_row[i] = silu_scalar[gb[i]]
        for i in range(II):
            h_row[i] = s_row[i] * u_f[i]
        for i in range(II):
            h = np.int64(h_u[i])
            bad |= (h & 0x7FFFFFFF) > 0x7F800000
            h_bits[m, i] = np.uint16(((h + 0x7FFF + ((h >> 16) & 1)) >> 16) & 0xFFFF)
        if bad:
            return False
        if want_f32:
            hf = h_f32[m].view(np.uint32)
            for i in range(II):
                hf[i] = np.uint32(h_bits[m, i]) << 16
    return True


@njit
def fc1_kernel(ids, k, a, a_amax, amax_native, h_amax, want_cap, cap_codes, cap_scales, w_codes, w_scales, w_amax, bias, has_bias,
               numerator, nib, sv, act_native, silu_vec, silu_scalar, n_vec, order, offs, gu, h_bits, h_f32):
    """ids i64 [M = T*k] flat expert ids; a f32 [T, H]; a_amax f32 [T] -> order i64 [M] (stable sort by
    expert), offs i32 [E], gu f32 [M, 2I]; with act_native the silu activation into h_bits u16 [M, I]
    (bf16) and h_f32 (its float32 values). Returns -1 (done), -2 (a NaN: the activation is the
    caller's), -3 (amax_native and a NaN in a: nothing done, the caller takes torch's amax), or the index
    of an expert id out of range. With amax_native, a_amax is written here (each row's max |value|, the
    per-row site amax: a max is exact, so torch's bits unless a NaN, whose bits torch decides) and, when
    the activation ran here, h_amax too (each sorted pair row of h)."""
    if amax_native and not row_amax_kernel(a, a_amax):
        return -3
    status, src, dest = sort_pairs(ids, k, w_codes.shape[0], want_cap, order, offs)
    if status >= 0:
        return status
    T, K = a.shape
    a_codes = np.empty((T, K // 2), dtype=np.uint8)
    a_scales = np.empty((T, K // 16), dtype=np.uint8)
    quantize_kernel(a, a_amax, numerator, a_codes, a_scales, np.empty((0, 0), dtype=np.float32), False, nib, sv)
    grouped_mm_kernel(a_codes, a_scales, a_amax, src, dest, cap_codes, cap_scales, w_codes, w_scales, w_amax,
                      offs, bias, has_bias, numerator, nib, sv, gu)
    if not act_native:
        return -1
    if not silu_rows(gu, silu_vec, silu_scalar, n_vec, h_bits, h_f32, True):
        return -2
    if amax_native:
        row_amax_kernel(h_f32, h_amax)  # no NaN here: checked above
    return -1


@njit
def fc2_kernel(h, h_amax, order, offs, k, want_cap, cap_codes, cap_scales, amax_pairs, w_codes, w_scales, w_amax,
               bias, has_bias, numerator, nib, sv, weights, sum_native, down, out):
    """h f32 [M, I] (sorted rows), h_amax f32 [M] -> down f32 [M, H] in (token, slot) order; with
    capture, row order[m]'s codes / scales / amax; with sum_native out f32 [T, H] = sum over slots of
    down * weight, summed as torch's outer sum (acc = 0, then the slots in order)."""
    M, I = h.shape
    codes = np.empty((M, I // 2), dtype=np.uint8)
    scales = np.empty((M, I // 16), dtype=np.uint8)
    quantize_kernel(h, h_amax, numerator, codes, scales, np.empty((0, 0), dtype=np.float32), False, nib, sv)
    fc2_rows(codes, scales, h_amax, order, offs, k, want_cap, cap_codes, cap_scales, amax_pairs, w_codes, w_scales,
             w_amax, bias, has_bias, numerator, nib, sv, weights, sum_native, down, out, False)


@njit
def fc2_rows(codes, scales, h_amax, order, offs, k, want_cap, cap_codes, cap_scales, amax_pairs, w_codes, w_scales,
             w_amax, bias, has_bias, numerator, nib, sv, weights, sum_native, down, out, serial):
    """fc2_kernel after its quantize: the sorted rows' codes u8 [M, I/2] / scales u8 [M, I/16] / h_amax f32 [M].
    serial: the grouped GEMM on this thread alone (grouped_mm_serial: the same bits, no parallel launch)."""
    M = codes.shape[0]
    if want_cap:
        for m in range(M):
            amax_pairs[order[m]] = h_amax[m]
        dest = order
    else:
        dest = np.empty(0, dtype=np.int64)
    src = np.arange(M)
    sorted_down = np.empty(down.shape, dtype=np.float32)
    if serial:
        grouped_mm_serial(codes, scales, h_amax, src, dest, cap_codes, cap_scales, w_codes, w_scales, w_amax,
                          offs, bias, has_bias, numerator, nib, sv, sorted_down)
    else:
        grouped_mm_kernel(codes, scales, h_amax, src, dest, cap_codes, cap_scales, w_codes, w_scales, w_amax,
                          offs, bias, has_bias, numerator, nib, sv, sorted_down)
    H = down.shape[1]
    for m in range(M):
        r = order[m]
        for n in range(H):
            down[r, n] = sorted_down[m, n]
    if not sum_native:
        return
    T = out.shape[0]
    for t in range(T):
        for n in range(H):
            out[t, n] = F32(0.0)
        for j in range(k):
            w = weights[t, j]
            for n in range(H):
                out[t, n] = out[t, n] + down[t * k + j, n] * w


_SILU = None


def silu_tables():
    """(vector-loop table, scalar-loop table, W): torch's float32 silu of every bf16 value from each of
    its two loops, and W, the values per vector-loop step (a row of n values runs n - n % W of them in
    the vector loop)."""
    global _SILU
    if _SILU is None:
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        vec = F.silu(x)  # contiguous, 65,536 = a multiple of any vector step: the vector loop
        scalar = F.silu(torch.stack((x, x), 1)[:, 0])  # strided input: the scalar loop throughout
        diff = ((vec.view(torch.int32) != scalar.view(torch.int32)) & ~torch.isnan(vec)).nonzero()
        W = 0
        if diff.numel():
            v = x[int(diff[0, 0])]
            for n in range(1, 257):  # the first length whose value 0 comes from the vector loop
                if torch.equal(F.silu(v.expand(n).contiguous())[0].view(torch.int32), vec[int(diff[0, 0])].view(torch.int32)):
                    W = n
                    break
            if W == 0:
                raise RuntimeError("trace_fp4: could not measure torch's silu vector step")
        _SILU = (vec.numpy().copy(), scalar.numpy().copy(), W)
    return _SILU


@njit
def moe_kernel(x_bits, ids, k, weights, want_cap, cap1_codes, cap1_scales, a_amax, w13_codes, w13_scales, w13_amax,
               w2_codes, w2_scales, w2_amax, numerator, nib, sv, silu_vec, silu_scalar, n_vec, cap2_codes, cap2_scales,
               cap2_amax, out_f32, out_bits, serial):
    """The engine's case in one call: fc1_kernel and fc2_kernel back to back with the per-row amax at both
    sites (computed here), the silu activation, no biases, the native weighted sum, and the cast of the
    output to bf16. x_bits i16 [T, H] (x's bf16 bits, as torch's int16 view hands them: the float32
    values are exact, bits << 16); ids int [T, k] (C-contiguous, any integer dtype, as the router gives
    them); weights f32 [T, k]. Writes a_amax f32 [T], the captures (want_cap: cap1 [T, H/2] / [T, H/16],
    cap2 [T, k, I/2] / [T, k, I/16] / amax [T, k], each pair's row in (token, slot) order), out_f32 f32
    [T, H] and out_bits i16 [T, H] (out_f32 rounded to bf16, round to nearest even: the bits
    of torch's `.to(bfloat16)`, subnormals and overflow to inf included). Returns -1 (done), -4 (done
    but a NaN in the output: its bf16 bits are torch's to decide, out_bits not to be used), or a status of
    fc1_kernel other than -1 (an expert id out of range, a NaN in x or in the activation: nothing
    returned here is used; the caller runs the general path, which raises or counts as it does). serial: both
    grouped GEMMs on this thread (grouped_mm_serial, the same bits; for a launch of one numba thread)."""
    T, H = x_bits.shape
    M = T * k
    ids = ids.reshape(M)
    E = w13_codes.shape[0]
    II = w2_codes.shape[2] * 2
    # fc1's input: x is bf16, so its row amax and its quantize run on the bits (kv_row_write's kernels: the
    # bits of row_amax_kernel / quantize_kernel on the widened values, without widening x first).
    x3 = x_bits.reshape(T, 1, H)
    amax1 = a_amax.reshape(T, 1)
    if not row_amax_bits_kernel(x3, amax1):
        return -3
    order = np.empty(M, dtype=np.int64)
    offs = np.empty(E, dtype=np.int32)
    status, src, dest = sort_pairs(ids, k, E, want_cap, order, offs)
    if status >= 0:
        return status
    a_codes = np.empty((T, H // 2), dtype=np.uint8)
    a_scales = np.empty((T, H // 16), dtype=np.uint8)
    quantize_bits_kernel(x3, amax1, numerator, a_codes.reshape(T, 1, H // 2), a_scales.reshape(T, 1, H // 16), sv)
    gu = np.empty((M, 2 * II), dtype=np.float32)
    no_bias = np.empty((0, 0), dtype=np.float32)
    if serial:
        grouped_mm_serial(a_codes, a_scales, a_amax, src, dest, cap1_codes, cap1_scales, w13_codes, w13_scales,
                          w13_amax, offs, no_bias, False, numerator, nib, sv, gu)
    else:
        grouped_mm_kernel(a_codes, a_scales, a_amax, src, dest, cap1_codes, cap1_scales, w13_codes, w13_scales,
                          w13_amax, offs, no_bias, False, numerator, nib, sv, gu)
    h_bits = np.empty((M, II), dtype=np.uint16)
    if not silu_rows(gu, silu_vec, silu_scalar, n_vec, h_bits, np.empty((0, 0), dtype=np.float32), False):
        return -2
    # fc2's input h is bf16 too (h_bits), never NaN here (checked above): the same two kernels on its bits.
    h3 = h_bits.reshape(M, 1, II)
    h_amax = np.empty(M, dtype=np.float32)
    amax2 = h_amax.reshape(M, 1)
    row_amax_bits_kernel(h3, amax2)
    codes2 = np.empty((M, II // 2), dtype=np.uint8)
    scales2 = np.empty((M, II // 16), dtype=np.uint8)
    quantize_bits_kernel(h3, amax2, numerator, codes2.reshape(M, 1, II // 2), scales2.reshape(M, 1, II // 16), sv)
    down = np.empty((M, H), dtype=np.float32)
    if want_cap:  # the pairs' rows: [T, k, ...] is [M, ...] in (token, slot) order
        c2, s2, a2 = cap2_codes.reshape(M, II // 2), cap2_scales.reshape(M, II // 16), cap2_amax.reshape(M)
    else:
        c2, s2, a2 = np.empty((0, 0), dtype=np.uint8), np.empty((0, 0), dtype=np.uint8), np.empty(0, dtype=np.float32)
    fc2_rows(codes2, scales2, h_amax, order, offs, k, want_cap, c2, s2, a2, w2_codes, w2_scales, w2_amax, no_bias,
             False, numerator, nib, sv, weights, True, down, out_f32, serial)
    ob = out_bits.view(np.uint16)
    ou = out_f32.view(np.uint32)  # bf16_bits' rounding on the bits, a row at a time (vectorises)
    for t in range(T):
        bad = 0
        for n in range(H):
            b = np.int64(ou[t, n])
            bad |= (b & 0x7FFFFFFF) > 0x7F800000
            ob[t, n] = np.uint16(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)
        if bad:
            return -4
    return -1


@njit
def moe_kernel_at(x_address, T, H, ids_address, ids64, k, weights_address, want_cap, cap1_codes, cap1_scales, a_amax,
                  w13_codes, w13_scales, w13_amax, w2_codes, w2_scales, w2_amax, numerator, nib, sv, silu_vec,
                  silu_scalar, n_vec, cap2_codes, cap2_scales, cap2_amax, out_f32, out_bits, ids_out, serial):
    """moe_kernel with x, the ids and the routing weights given as the addresses of C-contiguous tensors (the
    caller holds them for the call): x bf16 [T, H] read as its int16 bits, ids [T, k] int64 when ids64 else
    int32, weights float32 [T, k]. The same kernel on the same values, without the three numpy views (a
    `.numpy()` view is ~1 us of Python per tensor and call). `ids_out`: an int16 [T, k] array that gets the
    ids (the capture's routing rows: engine_call's `ids_into`), or a [0, 0] one (none wanted)."""
    x_bits = carray(int16_pointer(x_address), (T, H))
    weights = carray(float32_pointer(weights_address), (T, k))
    if ids64:
        ids64_rows = carray(int64_pointer(ids_address), (T, k))
        _ids_to_int16(ids64_rows, ids_out)
        return moe_kernel(x_bits, ids64_rows, k, weights, want_cap, cap1_codes,
                          cap1_scales, a_amax, w13_codes, w13_scales, w13_amax, w2_codes, w2_scales, w2_amax, numerator,
                          nib, sv, silu_vec, silu_scalar, n_vec, cap2_codes, cap2_scales, cap2_amax, out_f32, out_bits,
                          serial)
    ids32_rows = carray(int32_pointer(ids_address), (T, k))
    _ids_to_int16(ids32_rows, ids_out)
    return moe_kernel(x_bits, ids32_rows, k, weights, want_cap, cap1_codes, cap1_scales,
                      a_amax, w13_codes, w13_scales, w13_amax, w2_codes, w2_scales, w2_amax, numerator, nib, sv,
                      silu_vec, silu_scalar, n_vec, cap2_codes, cap2_scales, cap2_amax, out_f32, out_bits, serial)


@njit
def _ids_to_int16(ids, out):
    """The routing ids as the capture keeps them: int16, each id cast as C casts it (what numpy's assignment
    into an int16 array and torch's .to(torch.int16) do: the low 16 bits). Nothing where `out` has no rows
    (the caller wants none). Written before moe_kernel runs: a call it refuses (-2, -3: the general path
    then runs) leaves the rows to the caller's own routing write (CaptureStore.put_routing)."""
    if out.shape[0] == 0:
        return
    T, k = ids.shape
    for t in range(T):
        for j in range(k):
            out[t, j] = np.int16(ids[t, j])


def weight_views(w):
    """(codes, scales, amax) of a PackedExperts as numpy views, made once per object and kept on it: three
    `.numpy()` calls cost ~6 us per MoE call (each is detach, to, resolve_conj, resolve_neg in torch).
    Checked per call by each tensor's address alone (3 torch calls, not the 9 of address, shape and
    strides: ~1.4 -> ~0.5 us a weight warm, 2-3x that in the engine): a weight update in place (the
    usual one: quantize_expert_ copies into the same storage) is seen through the views, and a tensor
    given new storage (`.data = ...`, a replaced tensor) has a new address and gets new views, made and
    checked as at the first call. Shape and strides are taken whenever views are made; a change of
    them that keeps the address (an in-place resize_ / as_strided_ of a weight) is not seen per call:
    nothing in the project does that to a PackedExperts (its updates are quantize_expert_'s copies)."""
    codes, scales, amax = w.codes, w.scales, w.amax
    cached = w.__dict__.get("_native_views")
    if cached is not None and cached[0] == (codes.data_ptr(), scales.data_ptr(), amax.data_ptr()):
        return cached[1]
    key = (codes.data_ptr(), scales.data_ptr(), amax.data_ptr())  # the views' shapes and strides are the tensors' now
    views = (np_view(codes), np_view(scales), np_view(amax))
    if any(not t.is_contiguous() for t in (codes, scales, amax)):
        return views  # copies (np_view made them contiguous): not kept, they would go stale
    object.__setattr__(w, "_native_views", (key, views))  # PackedExperts is a frozen dataclass
    return views


def engine_case(x, topk_weights, topk_ids, activation, amax, b13, b2) -> bool:
    """Whether a call is the engine's usual one, which `moe_kernel` runs in one call: silu on bf16, the
    per-row amax at both sites, no biases, H % 64 == 0 and k <= 16 (the native weighted sum), float32
    routing weights and integer ids."""
    return (activation == "silu" and x.dtype == torch.bfloat16 and (amax is None or getattr(amax, "per_row", False))
            and b13 is None and b2 is None and x.shape[1] % 64 == 0 and topk_ids.shape[1] <= 16
            and topk_weights.dtype == torch.float32 and topk_ids.dtype in (torch.int32, torch.int64))


def routed_experts(x, topk_weights, topk_ids, w13, w2, activation, act, capture, amax, b13, b2):
    """`routed_experts.routed_experts` for CPU tensors and default block scales (validated there)."""
    if engine_case(x, topk_weights, topk_ids, activation, amax, b13, b2):
        done = engine_call(x, topk_weights, topk_ids, w13, w2, capture)
        if done is not None:
            return done
    return _general(x, topk_weights, topk_ids, w13, w2, activation, act, capture, amax, b13, b2)


def engine_call(x, topk_weights, topk_ids, w13, w2, capture, into=None, ids_into=None):
    """`moe_kernel` with numpy buffers made here (np.empty ~0.3 us against ~1.3 us for torch.empty,
    and no `.numpy()` call on them); None where the general path must run instead (see moe_kernel).
    Runs once per MoE layer call of the engine, so each line here counts: the fixed tables are one
    lookup (`_engine_consts`), x, the ids and the routing weights go in as the addresses of what vLLM hands
    over (moe_kernel_at: x's bf16 bits, the ids [T, k] int32 or int64 as they are), and the capture tensors
    are one numpy allocation each, wrapped by torch.from_numpy. `into` (with capture): the capture's rows to
    write instead (fc1 codes, scales, amax; fc2 codes, scales, amax: the capture store's host arena scratch for
    these T tokens); the call then returns (out, None, None). `ids_into`: an int16 [T, k] array (the store's routing
    scratch for these T tokens) the kernel writes the ids into, as int16 (CaptureStore.put_routing's cast), so the
    store needs no routing write of its own on this path; only a call that returns a result has written it."""
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w2.codes.shape[2] * 2
    consts = _CONSTS.get(I) or _engine_consts(I)
    # x, the ids and the weights go in by address (moe_kernel_at): contiguous tensors, held here for the call.
    if not x.is_contiguous():
        x = x.contiguous()
    if not topk_ids.is_contiguous():
        topk_ids = topk_ids.contiguous()
    if not topk_weights.is_contiguous():
        topk_weights = topk_weights.contiguous()
    if ids_into is not None and (ids_into.shape != (T, k) or ids_into.dtype != np.int16 or not ids_into.flags.c_contiguous):
        # the kernel writes T x k int16 values there unchecked
        raise ValueError(f"trace_fp4: ids_into must be a C-contiguous int16 [{T}, {k}] array, got "
                         f"{ids_into.dtype} {ids_into.shape}")
    if into is not None:  # the store's rows: nothing made here
        cap1, a_amax, cap2 = into[:2], into[2], into[3:]
    elif capture:  # fresh per call: the capture store keeps them (CaptureStore.put_owned)
        a_amax = np.empty(T, dtype=F32)
        cap1 = (np.empty((T, H // 2), dtype=np.uint8), np.empty((T, H // 16), dtype=np.uint8))
        cap2 = (np.empty((T, k, I // 2), dtype=np.uint8), np.empty((T, k, I // 16), dtype=np.uint8),
                np.empty((T, k), dtype=F32))
    else:
        a_amax = np.empty(T, dtype=F32)
        cap1, cap2 = _NO_CAP, _NO_CAP2
    out_f32 = np.empty((T, H), dtype=F32)
    out16 = np.empty((T, H), dtype=np.int16)
    with parallel_launch() as launch:  # one numba thread (the CPU engine's): the serial GEMMs, no parallel region
        status = moe_kernel_at(x.data_ptr(), T, H, topk_ids.data_ptr(), topk_ids.dtype == torch.int64, k,
                               topk_weights.data_ptr(), capture, cap1[0], cap1[1], a_amax, *weight_views(w13),
                               *weight_views(w2), *consts, cap2[0], cap2[1], cap2[2], out_f32, out16,
                               _NO_IDS if ids_into is None else ids_into, launch.threads == 1)
    if status not in (-1, -4):
        return None
    CALLS["routed_experts"] += 1
    out = torch.from_numpy(out16).view(torch.bfloat16) if status == -1 else torch.from_numpy(out_f32).to(torch.bfloat16)
    if not capture or into is not None:
        return out, None, None
    nvfp4 = _nvfp4_class()
    q1 = nvfp4(torch.from_numpy(cap1[0]), torch.from_numpy(cap1[1]), torch.from_numpy(a_amax))
    q2 = nvfp4(torch.from_numpy(cap2[0]), torch.from_numpy(cap2[1]), torch.from_numpy(cap2[2]))
    return out, q1, q2


_CONSTS: dict = {}
_NO_IDS = np.empty((0, 0), dtype=np.int16)  # moe_kernel_at's ids_out where no routing rows are wanted


def _engine_consts(I: int) -> tuple:
    """moe_kernel's fixed arguments for intermediate size I (numerator, nib, sv, silu_vec, silu_scalar,
    n_vec), made once: three table lookups and the n_vec arithmetic cost ~2 us a call in the engine."""
    nib, sv = tables()
    silu_vec, silu_scalar, W = silu_tables()
    _CONSTS[I] = (NUMERATOR["6"], nib, sv, silu_vec, silu_scalar, I - I % W if W else I)
    return _CONSTS[I]


@functools.cache
def _nvfp4_class():
    """NVFP4Tensor, imported once (an import statement per call costs ~1 us; a module-level import would
    be circular: trace_kernels.tensor imports the backends)."""
    from ..tensor import NVFP4Tensor

    return NVFP4Tensor


def _general(x, topk_weights, topk_ids, w13, w2, activation, act, capture, amax, b13, b2):
    """Every other case (and the engine's where moe_kernel met a NaN or a bad id): two kernel calls around
    torch's activation or the site's own amax where those are not native."""
    CALLS["routed_experts"] += 1
    T, H = x.shape
    k = topk_ids.shape[1]
    E, I = w2.shape[0], w2.shape[2]
    M = T * k
    dtype = x.dtype
    nib, sv = tables()
    numerator = NUMERATOR["6"]
    act_native = activation == "silu" and dtype == torch.bfloat16
    if act_native:
        silu_vec, silu_scalar, W = silu_tables()
        n_vec = I - I % W if W else I
    else:
        silu_vec = silu_scalar = _NO_TABLE
        n_vec = 0
        torch_for(f"moe_activation_{activation}_{str(dtype).removeprefix('torch.')}",
                  "the native activation is silu on bf16 (a table of torch's own values)")

    # The per-row amax (the engines' non-static site amax) is computed inside the kernels: two fewer
    # torch ops chains (abs, amax, cast) per site and call; a row with a NaN takes torch's (its bits).
    amax_native = amax is None or getattr(amax, "per_row", False)
    site_amax = amax if amax is not None else _per_row
    x32 = np_view(x.to(torch.float32))
    if amax_native:
        amax1 = torch.from_numpy(np.empty(T, dtype=F32))
        amax2_sorted = np.empty(M, dtype=np.float32)
    else:
        amax1 = amax("moe_fc1_in", x)
        amax2_sorted = _NO_AMAX
    order = np.empty(M, dtype=np.int64)
    offs = torch.empty(E, dtype=torch.int32)
    gu = np.empty((M, 2 * I), dtype=np.float32)
    h_bits = torch.empty((M, I), dtype=torch.bfloat16)
    h_f32 = np.empty((M, I), dtype=np.float32)
    ids = np_view(topk_ids.reshape(-1).to(torch.int64))
    h_u16 = h_bits.view(torch.int16).numpy().view(np.uint16)
    w13_args = (np_view(w13.codes), np_view(w13.scales), np_view(w13.amax),
                np_view(b13) if b13 is not None else _NO_BIAS, b13 is not None)
    # The captures are made as numpy arrays, then wrapped (torch.from_numpy): torch.empty and .numpy() cost
    # ~2.8 us a tensor on this CPU, np.empty and from_numpy ~0.7 us, and a call makes five of them. The
    # tensors are fresh per call, which the capture store relies on (CaptureStore.put_owned keeps them).
    if capture:
        cap1 = (np.empty((T, H // 2), dtype=np.uint8), np.empty((T, H // 16), dtype=np.uint8))
    else:
        cap1 = _NO_CAP

    def fc1(a_amax, native_amax):
        with parallel_launch():  # fc1's grouped GEMM runs the experts on torch's thread count
            return fc1_kernel(ids, k, x32, np_view(a_amax), native_amax, amax2_sorted, capture, cap1[0], cap1[1],
                              *w13_args, numerator, nib, sv, act_native, silu_vec, silu_scalar, n_vec, order,
                              offs.numpy(), gu, h_u16, h_f32)

    status = fc1(amax1, amax_native)
    if status == -3:  # a NaN in x: torch's amax (its NaN bits decide), then the kernel with it
        # Not counted as a fallback of its own: torch computed every amax before this kernel did, and a
        # NaN in x reaches gate/up, where the activation's torch run is counted (routed_experts_nan).
        amax_native = False
        amax1 = site_amax("moe_fc1_in", x)
        status = fc1(amax1, False)
    q1 = NVFP4(torch.from_numpy(cap1[0]), torch.from_numpy(cap1[1]), amax1) if capture else None
    if status >= 0:
        raise ValueError(f"topk_ids holds expert id {int(topk_ids.reshape(-1)[status])}, outside [0, {E})")
    if act_native and status == -2:
        torch_for("routed_experts_nan", "a NaN's bits after torch's bf16 cast depend on its position")
        act_native = False
    if act_native:
        h = h_bits
    else:  # torch's own code (routed_experts step 3)
        g = torch.from_numpy(gu).to(dtype).float()
        h = act(g[:, :I], g[:, I:]).to(dtype)
        h_f32 = np_view(h.to(torch.float32))

    if amax_native and act_native:  # written by fc1_kernel
        amax2 = amax2_sorted
    else:
        amax2 = np_view(site_amax("moe_fc2_in", h).to(torch.float32))
    sum_native = H % 64 == 0 and k <= 16
    q2 = None
    if capture:  # numpy first, as cap1 above; the reshapes are views (C-contiguous arrays)
        cap2 = (np.empty((M, I // 2), dtype=np.uint8), np.empty((M, I // 16), dtype=np.uint8), np.empty(M, dtype=F32))
        q2 = NVFP4(torch.from_numpy(cap2[0].reshape(T, k, I // 2)), torch.from_numpy(cap2[1].reshape(T, k, I // 16)),
                   torch.from_numpy(cap2[2].reshape(T, k)))
    else:
        cap2 = _NO_CAP + (_NO_AMAX,)
    down = torch.empty((M, H), dtype=torch.float32)
    out = torch.empty((T, H) if sum_native else (0, 0), dtype=torch.float32)
    weights = topk_weights.to(torch.float32)
    with parallel_launch():
        fc2_kernel(h_f32, amax2, order, offs.numpy(), k, capture, cap2[0], cap2[1], cap2[2],
                   np_view(w2.codes), np_view(w2.scales), np_view(w2.amax), np_view(b2) if b2 is not None else _NO_BIAS,
                   b2 is not None, numerator, nib, sv, np_view(weights), sum_native, down.numpy(), out.numpy())
    if not sum_native:
        torch_for("routed_experts_weighted_sum", "torch's outer sum is matched for H % 64 == 0 and k <= 16")
        out = (down.view(T, k, H) * weights.view(T, k, 1)).sum(dim=1)
    return out.to(dtype), q1, q2


def _per_row(site, rows):
    return row_amax(rows)


def NVFP4(codes, scales, amax):
    from ..tensor import NVFP4Tensor

    return NVFP4Tensor(codes, scales, amax)


_NO_TABLE = np.empty(0, dtype=np.float32)
_NO_BIAS = np.empty((0, 0), dtype=np.float32)
_NO_CAP = (np.empty((0, 0), dtype=np.uint8), np.empty((0, 0), dtype=np.uint8))
_NO_AMAX = np.empty(0, dtype=np.float32)
_NO_CAP2 = (np.empty((0, 0, 0), dtype=np.uint8), np.empty((0, 0, 0), dtype=np.uint8), np.empty((0, 0), dtype=np.float32))
