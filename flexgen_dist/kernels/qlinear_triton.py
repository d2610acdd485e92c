"""The Triton kernels of ``qlinear_gpu`` (which says what they compute), defined at module level:
Triton reads a kernel's source back, which works for a module's functions on every Python.
Importing this module imports Triton; ``qlinear_gpu`` imports it only when a GPU product or
expansion is asked for. ``TRITON_INTERPRET=1`` must be set before the import to run them in
Triton's interpreter."""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _expand_tile(codes_ptr, mins_ptr, scales_ptr, table_ptr, rows, rows_ok, c0, PACKED, GROUPS, stride_c, stride_g,
                 GROUP: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                 INTERPRET: tl.constexpr, TABLE: tl.constexpr):
    """Columns [c0, c0 + COLS) of the given rows, expanded in float32: ``code * scale + min``,
    the product rounded on its own (``mul_rn``, never fused with the add), as the reference
    rounds it; with ``TABLE`` (a 4-bit table format) ``table[code] * scale``, no mins. Codes,
    mins and scales past the ends read as 0."""
    if BITS == 4:
        rb = c0 // 2 + tl.arange(0, COLS // 2)
        c = tl.load(codes_ptr + rows[:, None] * stride_c + rb[None, :], mask=rows_ok[:, None] & (rb < PACKED)[None, :],
                    other=0)
        w = tl.reshape(tl.join(c & 15, c >> 4), (ROWS, COLS))  # low nibble first
    else:
        rc = c0 + tl.arange(0, COLS)
        w = tl.load(codes_ptr + rows[:, None] * stride_c + rc[None, :], mask=rows_ok[:, None] & (rc < PACKED)[None, :],
                    other=0)
    rg = c0 // GROUP + tl.arange(0, COLS // GROUP)
    g_mask = rows_ok[:, None] & (rg < GROUPS)[None, :]
    sc = tl.load(scales_ptr + rows[:, None] * stride_g + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
    if TABLE:  # each code's entry of the format's 16 values
        wv = tl.load(table_ptr + w.to(tl.int32))
    else:
        wv = w.to(tl.float32)
    wf = tl.reshape(wv, (ROWS, COLS // GROUP, GROUP))
    sb = tl.broadcast_to(sc[:, :, None], (ROWS, COLS // GROUP, GROUP))
    if INTERPRET:  # numpy never fuses a product with the add
        prod = wf * sb
    else:
        prod = libdevice.mul_rn(wf, sb)
    if TABLE:
        return tl.reshape(prod, (ROWS, COLS))
    mn = tl.load(mins_ptr + rows[:, None] * stride_g + rg[None, :], mask=g_mask, other=0.0).to(tl.float32)
    return tl.reshape(prod + mn[:, :, None], (ROWS, COLS))


@triton.jit
def qlinear_kernel(x_ptr, codes_ptr, mins_ptr, scales_ptr, table_ptr, b_ptr, r_ptr, y_ptr, part_ptr,
                   M, N, K, PACKED, GROUPS, K_PER, stride_xm, stride_cn, stride_gn, stride_rm, stride_ym,
                   GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, TABLE: tl.constexpr):
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
        wf = _expand_tile(codes_ptr, mins_ptr, scales_ptr, table_ptr, rn, n_ok, k0, PACKED, GROUPS, stride_cn,
                          stride_gn, GROUP, BITS, BLOCK_N, BLOCK_K, WIDEN, TABLE)
        wt = tl.trans(wf.to(x.dtype))
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
def dequant_kernel(codes_ptr, mins_ptr, scales_ptr, table_ptr, y_ptr, R, C, PACKED, GROUPS, stride_cr, stride_gr,
                   stride_yr, GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   INTERPRET: tl.constexpr, TABLE: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = rr < R
    y = _expand_tile(codes_ptr, mins_ptr, scales_ptr, table_ptr, rr, r_ok, pid_c * BLOCK_C, PACKED, GROUPS, stride_cr,
                     stride_gr, GROUP, BITS, BLOCK_R, BLOCK_C, INTERPRET, TABLE)
    tl.store(y_ptr + rr[:, None] * stride_yr + rc[None, :], y.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (rc < C)[None, :])
