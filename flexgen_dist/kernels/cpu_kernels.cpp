// CPU kernels, compiled on first use for the machine that runs them
// (flexgen_dist/kernels/__init__.py builds this file with -O3 -march=native -fopenmp
// -ffp-contract=off). Decode: linear_f32 (attention: cpu_attention.cpp). Every
// pass: rms_norm, rope, silu_mul in float32, bfloat16 and float16, each a template over the
// dtype rounded as torch's path for that dtype rounds (one read and one write instead of
// torch's several passes).
//
// linear_f32: y = x @ w.T (+ bias) for a few rows of x (a decode step: the rows are the
// sequences of a batch). The BLAS repacks the whole weight matrix on every call, which for a
// few rows costs more than the product itself. Here each weight row is read once, straight
// from its (out, in) row-major layout, and dotted with a block of x rows held in L1/L2:
// NB weight rows x MB x rows of SIMD partial sums live in registers, summed across lanes at
// the end of the row.
//
// The OpenMP runtime is the process's: torch has libgomp.so.1 loaded before this library,
// and the loader resolves the same soname to it, so both share one thread pool.
#include "cpu_simd.h"


extern "C" {

int fg_vector_width(void) { return VW; }

// y (M, N) with row stride ldy = x (M, K; row stride ldx) @ w.T, w (N, K; row stride ldw),
// plus bias (N) when not null, plus res (M, N; row stride ldy) when not null, in that order
// (as F.linear(x, w, bias).add_(res) rounds). Parallel over blocks of weight rows.
void fg_linear_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* w, int64_t N,
                   int64_t ldw, const float* bias, const float* res, float* y, int64_t ldy, int nthreads) {
    int64_t nblocks = (N + NB - 1) / NB;
    int64_t iters = ((M + MB - 1) / MB) * (K / VW > 0 ? K / VW : 1);  // inner iterations per block
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t n = b * NB;
        const float* wn = w + n * ldw;
        const float* bn = bias ? bias + n : nullptr;
        const float* rn = res ? res + n : nullptr;
        float* yn = y + n;
        int64_t next_end = n + 2 * NB < N ? n + 2 * NB : N;
        int64_t bytes = n + NB < N ? (next_end - n - NB) * ldw * 4 : 0;
        int64_t lines = (bytes + 63) / 64;
        Prefetch pf{(const char*)(wn + NB * ldw), (const char*)(wn + NB * ldw) + bytes, (lines + iters - 1) / iters};
        TailN<NB>::run(N - n >= NB ? NB : N - n, x, M, ldx, wn, ldw, K, bn, rn, yn, ldy, pf);
    }
}

}  // extern "C"

// nr (<= NB) weight rows w (row stride ldw) against M rows of x: linear_f32's register blocks,
// for the fused quantized product's float32 panels (cpu_qlinear.cpp), so their template
// instances are compiled once, here.
extern "C" void fg_panel_f32(int64_t nr, const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw,
                             int64_t K, const float* bias, const float* res, float* y, int64_t ldy) {
    Prefetch pf{nullptr, nullptr, 0};
    TailN<NB>::run(nr, x, M, ldx, w, ldw, K, bias, res, y, ldy, pf);
}

// The elementwise kernels below take float32, bfloat16 or float16 (DT) and compute in float32,
// rounding to the dtype exactly where torch's own path for that dtype rounds (for float32 the
// roundings are no-ops, and the float32 kernels are these same templates); Elem<DT> is the
// element (cpu_simd.h).

// RMSNorm: y (M, n) contiguous = round(round(x * r) * w), r = 1 / sqrt(mean(x^2) + eps), x rows
// ldx apart, in one read of x and one write of y (torch's CPU rms_norm runs five passes). The
// order is the reference implementation's: (x * r) * w in float32; a half dtype normalised in
// float32, rounded, then multiplied by the weight in the dtype.
template <int DT>
static void rms_norm(const Elem<DT>* x, int64_t M, int64_t n, int64_t ldx, const Elem<DT>* w, float eps,
                     Elem<DT>* y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * n >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const Elem<DT>* xm = x + m * ldx;
        Elem<DT>* ym = y + m * n;
        vf acc = vzero();
        int64_t e = 0;
        for (; e + VW <= n; e += VW) {
            vf v = vload_as_f32<DT>(xm + e);
            acc = vfma(v, v, acc);
        }
        float ss = hsum(acc);
        for (int64_t t = e; t < n; t++) ss += ld1<DT>(xm, t) * ld1<DT>(xm, t);
        const float r = 1.f / sqrtf(ss / (float)n + eps);
        const vf rv = _set1(r);
        for (e = 0; e + VW <= n; e += VW)
            vstore_as<DT>(ym + e, vround<DT>(vload_as_f32<DT>(xm + e) * rv) * vload_as_f32<DT>(w + e));
        for (int64_t t = e; t < n; t++) ym[t] = to_dt<DT>(rnd1<DT>(ld1<DT>(xm, t) * r) * ld1<DT>(w, t));
    }
}

// g = silu(g) * u in place over n elements, as torch's silu (g / (1 + e^-g), rounded to the
// dtype) then mul.
template <int DT>
static void silu_mul(Elem<DT>* g, const Elem<DT>* u, int64_t n, int nthreads) {
    int64_t nv = n / VW;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
    for (int64_t b = 0; b < nv; b++) {
        vf x = vload_as_f32<DT>(g + b * VW);
        vstore_as<DT>(g + b * VW, vround<DT>(x / (_set1(1.f) + vexp(-x))) * vload_as_f32<DT>(u + b * VW));
    }
    for (int64_t i = nv * VW; i < n; i++) {
        const float x = ld1<DT>(g, i);
        g[i] = to_dt<DT>(rnd1<DT>(x / (1.f + expf(-x))) * ld1<DT>(u, i));
    }
}

// Rotary embedding, rotate-half convention, out of place: x and out (P, H, d) contiguous
// (P positions of H heads), cos and sin (P, d). First half: x1 * c - x2 * s; second half:
// x2 * c + x1 * s; each product rounded before the sum, as x * cos + rotate_half(x) * sin in
// float32; a half dtype as torch's path there rounds (x * cos rounded, then each half's
// addcmul_: the other product in float32, the sum rounded once).
template <int DT>
static void rope(const Elem<DT>* x, int64_t P, int64_t H, int64_t d, const Elem<DT>* cos, const Elem<DT>* sin,
                 Elem<DT>* out, int nthreads) {
    const int64_t h = d / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (P * H * d >= 65536)
    for (int64_t p = 0; p < P; p++) {
        const Elem<DT>* c = cos + p * d;
        const Elem<DT>* s = sin + p * d;
        for (int64_t hd = 0; hd < H; hd++) {
            const Elem<DT>* x1 = x + (p * H + hd) * d;
            const Elem<DT>* x2 = x1 + h;
            Elem<DT>* o1 = out + (p * H + hd) * d;
            Elem<DT>* o2 = o1 + h;
            int64_t e = 0;
            for (; e + VW <= h; e += VW) {
                vf a = vload_as_f32<DT>(x1 + e), b = vload_as_f32<DT>(x2 + e);
                vstore_as<DT>(o1 + e, vround<DT>(a * vload_as_f32<DT>(c + e)) - b * vload_as_f32<DT>(s + e));
                vstore_as<DT>(o2 + e, vround<DT>(b * vload_as_f32<DT>(c + h + e)) + a * vload_as_f32<DT>(s + h + e));
            }
            for (; e < h; e++) {
                const float a = ld1<DT>(x1, e), b = ld1<DT>(x2, e);
                o1[e] = to_dt<DT>(rnd1<DT>(a * ld1<DT>(c, e)) - b * ld1<DT>(s, e));
                o2[e] = to_dt<DT>(rnd1<DT>(b * ld1<DT>(c, h + e)) + a * ld1<DT>(s, h + e));
            }
        }
    }
}

extern "C" {

// The elementwise kernels for a dtype code dt (0 float32, 1 bfloat16, 2 float16), as
// fg_attention (cpu_attention.cpp); see rms_norm, silu_mul and rope above.
void fg_rms_norm(const void* x, int64_t M, int64_t n, int64_t ldx, const void* w, float eps, void* y, int dt,
                 int nthreads) {
    if (dt == DT_BF16) rms_norm<DT_BF16>((const uint16_t*)x, M, n, ldx, (const uint16_t*)w, eps, (uint16_t*)y, nthreads);
    else if (dt == DT_F16) rms_norm<DT_F16>((const uint16_t*)x, M, n, ldx, (const uint16_t*)w, eps, (uint16_t*)y, nthreads);
    else rms_norm<DT_F32>((const float*)x, M, n, ldx, (const float*)w, eps, (float*)y, nthreads);
}

void fg_silu_mul(void* g, const void* u, int64_t n, int dt, int nthreads) {
    if (dt == DT_BF16) silu_mul<DT_BF16>((uint16_t*)g, (const uint16_t*)u, n, nthreads);
    else if (dt == DT_F16) silu_mul<DT_F16>((uint16_t*)g, (const uint16_t*)u, n, nthreads);
    else silu_mul<DT_F32>((float*)g, (const float*)u, n, nthreads);
}

void fg_rope(const void* x, int64_t P, int64_t H, int64_t d, const void* cos, const void* sin, void* out, int dt,
             int nthreads) {
    using H16 = const uint16_t*;
    if (dt == DT_BF16) rope<DT_BF16>((H16)x, P, H, d, (H16)cos, (H16)sin, (uint16_t*)out, nthreads);
    else if (dt == DT_F16) rope<DT_F16>((H16)x, P, H, d, (H16)cos, (H16)sin, (uint16_t*)out, nthreads);
    else rope<DT_F32>((const float*)x, P, H, d, (const float*)cos, (const float*)sin, (float*)out, nthreads);
}

}  // extern "C"
