"""The Triton kernels of ``qlinear_gpu`` (which says what they compute), defined at module level:
Triton reads a kernel's source back, which works for a module's functions on every Python.
Importing this module imports Triton; ``qlinear_gpu`` imports it only when a GPU product or
expansion is asked for. ``TRITON_INTERPRET=1`` must be set before the import to run them in
Triton's interpreter."""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def qlinear_kernel(x_ptr, codes_ptr, mins_ptr, scales_ptr, b_ptr, r_ptr, y_ptr, part_ptr,
                   M, N, K, PACKED, GROUPS, K_PER, stride_xm, stride_cn, stride_gn, stride_rm, stride_ym,
                   GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER  # this program's share of the input dim (all of it without split-K)
    for k0 in range(k_start, tl.minimum(k_start + K_PER, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                    other=0.0)
        if BITS == 4:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            c = tl.load(codes_ptr + rn[:, None] * stride_cn + rb[None, :],
                        mask=n_ok[:, None] & (rb < PACKED)[None, :], other=0)
            w = tl.reshape(tl.join(c & 15, c >> 4), (BLOCK_N, BLOCK_K))
        else:
            c = tl.load(codes_ptr + rn[:, None] * stride_cn + rk[None, :],
                        mask=n_ok[:, None] & (rk < PACKED)[None, :], other=0)
            w = c
        rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_mask = n_ok[:, None] & (rg < GROUPS)[None, :]
        s = tl.load(scales_ptr + rn[:, None] * stride_gn + rg[None, :], mask=g_mask, other=0.0)
        mn = tl.load(mins_ptr + rn[:, None] * stride_gn + rg[None, :], mask=g_mask, other=0.0)
        wf = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP))
        sb = tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP))
        if WIDEN:  # the interpreter (numpy) never fuses a product with the add
            wf = wf * sb + mn.to(tl.float32)[:, :, None]
        else:  # the product rounded on its own, as the reference rounds it
            wf = libdevice.mul_rn(wf, sb) + mn.to(tl.float32)[:, :, None]
        wt = tl.trans(tl.reshape(wf, (BLOCK_N, BLOCK_K)).to(x.dtype))
        if IEEE:
            acc += tl.dot(x, wt, input_precision="ieee")
        elif WIDEN:  # the same products (a half type's are exact in float32), widened first
            acc += tl.dot(x.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, wt)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:  # float32 partial sums; the caller adds them up and finishes
        tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=out_mask)
        return
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=out_mask)

@triton.jit
def dequant_kernel(codes_ptr, mins_ptr, scales_ptr, y_ptr, R, C, PACKED, GROUPS, stride_cr, stride_gr, stride_yr,
                   GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   COMPILED: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = rr < R
    if BITS == 4:
        rb = pid_c * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
        c = tl.load(codes_ptr + rr[:, None] * stride_cr + rb[None, :], mask=r_ok[:, None] & (rb < PACKED)[None, :],
                    other=0)
        w = tl.reshape(tl.join(c & 15, c >> 4), (BLOCK_R, BLOCK_C))
    else:
        w = tl.load(codes_ptr + rr[:, None] * stride_cr + rc[None, :], mask=r_ok[:, None] & (rc < PACKED)[None, :],
                    other=0)
    rg = pid_c * (BLOCK_C // GROUP) + tl.arange(0, BLOCK_C // GROUP)
    g_mask = r_ok[:, None] & (rg < GROUPS)[None, :]
    sc = tl.load(scales_ptr + rr[:, None] * stride_gr + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
    mn = tl.load(mins_ptr + rr[:, None] * stride_gr + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
    wf = tl.reshape(w.to(tl.float32), (BLOCK_R, BLOCK_C // GROUP, GROUP))
    sb = tl.broadcast_to(sc[:, :, None], (BLOCK_R, BLOCK_C // GROUP, GROUP))
    if COMPILED:  # a product rounded on its own, never fused with the add: the reference's roundings
        prod = libdevice.mul_rn(wf, sb)
    else:  # the interpreter (numpy) never fuses
        prod = wf * sb
    y = tl.reshape(prod + mn[:, :, None], (BLOCK_R, BLOCK_C))
    tl.store(y_ptr + rr[:, None] * stride_yr + rc[None, :], y.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (rc < C)[None, :])
