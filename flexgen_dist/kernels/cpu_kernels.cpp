// Float32 CPU kernels, compiled on first use for the machine that runs them
// (flexgen_dist/kernels/__init__.py builds this file with -O3 -march=native -fopenmp
// -ffp-contract=off). Decode: linear_f32, attention_f32. Every pass: rms_norm_f32,
// rope_f32, silu_mul_f32 (one read and one write instead of torch's several passes).
//
// linear_f32: y = x @ w.T (+ bias) for a few rows of x (a decode step: the rows are the
// sequences of a batch). The BLAS repacks the whole weight matrix on every call, which for a
// few rows costs more than the product itself. Here each weight row is read once, straight
// from its (out, in) row-major layout, and dotted with a block of x rows held in L1/L2:
// NB weight rows x MB x rows of SIMD partial sums live in registers, summed across lanes at
// the end of the row.
//
// dequant_f32: group-wise 4/8-bit codes back to float32 in one pass (see its comment).
//
// attention_f32: decode attention of one query position over a KV cache laid out as rows
// of (sequence, kv head), each row's positions contiguous (the engine's row-major chunks,
// read in place). The G query heads of a kv head share one pass over its keys and values,
// which are read once, in order; scores, softmax and the weighted sum of values stay in
// the core's caches.
//
// The OpenMP runtime is the process's: torch has libgomp.so.1 loaded before this library,
// and the loader resolves the same soname to it, so both share one thread pool.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

#if defined(__AVX512F__)
#define VW 16
#ifndef NB
#define NB 6
#define MB 4
#endif
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf _set1(float a) { return _mm512_set1_ps(a); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vpow2i(vf n) {  // 2^n for integral n in [-127, 128]
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
}
static inline vf vzero_below(vf v, vf x, float lo) {  // v where x >= lo, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _set1(lo), _CMP_GE_OQ), v);
}
static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define NB 2
#define MB 6
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf _set1(float a) { return _mm256_set1_ps(a); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vfloor(vf a) { return _mm256_floor_ps(a); }
static inline vf vpow2i(vf n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
static inline vf vzero_below(vf v, vf x, float lo) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, _set1(lo), _CMP_GE_OQ));
}
static inline float hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline float hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#else
#error "flexgen_dist CPU kernels need AVX2 with FMA or AVX-512"
#endif

// e^x, Cephes' expf polynomial: within 2 ulp of expf over [-87.3, 88.7]; exactly 0 below
// (masked softmax positions are -inf), e^88.7 above.
static inline vf vexp(vf x) {
    const float lo = -87.3f;
    vf xc = vmax(x, _set1(lo));
    xc = vmin(xc, _set1(88.7f));
    vf n = vfloor(vfma(xc, _set1(1.44269504088896341f), _set1(0.5f)));
    vf r = vfma(n, _set1(-0.693359375f), xc);
    r = vfma(n, _set1(2.12194440e-4f), r);
    vf p = _set1(1.9875691500e-4f);
    p = vfma(p, r, _set1(1.3981999507e-3f));
    p = vfma(p, r, _set1(8.3334519073e-3f));
    p = vfma(p, r, _set1(4.1665795894e-2f));
    p = vfma(p, r, _set1(1.6666665459e-1f));
    p = vfma(p, r, _set1(5.0000001201e-1f));
    p = vfma(p, r * r, r + _set1(1.f));
    return vzero_below(p * vpow2i(n), x, lo);
}

// Software prefetch of the next block of weight rows while this one computes: without it
// the first pass over a block waits on memory and the passes of the other x rows then only
// compute, one after the other (cold weights: 45 ms -> 30 ms for SmolLM2's 30 layers at
// 32 rows). ``step`` lines per inner iteration spread the block's lines over its work.
struct Prefetch {
    const char* p;
    const char* end;
    int64_t step;
    inline void next() {
        for (int64_t s = 0; s < step && p < end; s++, p += 64) _mm_prefetch(p, _MM_HINT_T0);
    }
};

// One block of nb weight rows x mb x rows; nb <= NB and mb <= MB are compile-time constants
// in every instantiation, so the accumulators stay in registers.
template <int nb, int mb>
static inline void block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                         const float* bias, const float* res, float* y, int64_t ldy, Prefetch& pf) {
    vf acc[nb][mb];
#pragma GCC unroll 8
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) acc[i][j] = vzero();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        pf.next();
        vf wv[nb];
#pragma GCC unroll 8
        for (int i = 0; i < nb; i++) wv[i] = vload(w + i * ldw + k);
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) {
            vf xv = vload(x + j * ldx + k);
#pragma GCC unroll 8
            for (int i = 0; i < nb; i++) acc[i][j] = vfma(wv[i], xv, acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nb; i++) {
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t kk = k; kk < K; kk++) s += w[i * ldw + kk] * x[j * ldx + kk];
            if (bias) s += bias[i];
            y[j * ldy + i] = res ? s + res[j * ldy + i] : s;
        }
    }
}

// A tail of r < mb rows (or weight rows): dispatched to the block of exactly that size.
template <int nb, int mb>
struct TailM {
    static void run(int64_t r, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                    const float* bias, const float* res, float* y, int64_t ldy, Prefetch& pf) {
        if (r == mb) block<nb, mb>(x, ldx, w, ldw, K, bias, res, y, ldy, pf);
        else TailM<nb, mb - 1>::run(r, x, ldx, w, ldw, K, bias, res, y, ldy, pf);
    }
};
template <int nb>
struct TailM<nb, 0> {
    static void run(int64_t, const float*, int64_t, const float*, int64_t, int64_t, const float*, const float*,
                    float*, int64_t, Prefetch&) {}
};

template <int nb>
static void rows(const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                 const float* bias, const float* res, float* y, int64_t ldy, Prefetch& pf) {
    int64_t m = 0;
    for (; m + MB <= M; m += MB)
        block<nb, MB>(x + m * ldx, ldx, w, ldw, K, bias, res ? res + m * ldy : res, y + m * ldy, ldy, pf);
    if (m < M)
        TailM<nb, MB - 1>::run(M - m, x + m * ldx, ldx, w, ldw, K, bias, res ? res + m * ldy : res, y + m * ldy,
                               ldy, pf);
}

template <int nb>
struct TailN {
    static void run(int64_t r, const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                    const float* bias, const float* res, float* y, int64_t ldy, Prefetch& pf) {
        if (r == nb) rows<nb>(x, M, ldx, w, ldw, K, bias, res, y, ldy, pf);
        else TailN<nb - 1>::run(r, x, M, ldx, w, ldw, K, bias, res, y, ldy, pf);
    }
};
template <>
struct TailN<0> {
    static void run(int64_t, const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                    const float*, float*, int64_t, Prefetch&) {}
};

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

// out (R, G, d) = softmax(q k^T * scale, masked) v for each row r: q (R, G, d) contiguous,
// k/v rows r0 + r at k + r * ldk with positions d apart (positions [0, L)), mask (R, L) with
// row stride ldm (nonzero = visible; every row must see at least one position).
// d must be a multiple of the vector width.
void fg_attention_f32(const float* q, int64_t R, int64_t G, int64_t d, const float* k, int64_t ldk,
                      const float* v, int64_t ldv, int64_t L, const uint8_t* mask, int64_t ldm,
                      float scale, float* out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t Lp = (L + VW - 1) / VW * VW;  // each head's scores padded with -inf
        std::vector<float> s((size_t)(G * Lp)), o((size_t)(G * d));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const float* qr = q + r * G * d;
            const float* kr = k + r * ldk;
            const float* vr = v + r * ldv;
            const uint8_t* mr = mask + r * ldm;
            for (int64_t g = 0; g < G; g++)  // the softmax below overwrites the padding
                for (int64_t l = L; l < Lp; l++) s[g * Lp + l] = -INFINITY;
            for (int64_t l = 0; l < L; l++) {
                const float* kl = kr + l * d;
                for (int64_t g = 0; g < G; g++) {
                    if (!mr[l]) {
                        s[g * Lp + l] = -INFINITY;
                        continue;
                    }
                    vf acc = vzero();
                    for (int64_t e = 0; e < d; e += VW) acc = vfma(vload(qr + g * d + e), vload(kl + e), acc);
                    s[g * Lp + l] = hsum(acc) * scale;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float* sg = s.data() + g * Lp;
                vf mv = _set1(-INFINITY);
                for (int64_t l = 0; l < Lp; l += VW) mv = vmax(mv, vload(sg + l));
                vf mx = _set1(hmax(mv)), sv = vzero();
                for (int64_t l = 0; l < Lp; l += VW) {
                    vf e = vexp(vload(sg + l) - mx);
                    vstore(sg + l, e);
                    sv = sv + e;
                }
                vf inv = _set1(1.f / hsum(sv));
                for (int64_t l = 0; l < Lp; l += VW) vstore(sg + l, vload(sg + l) * inv);
            }
            // out = p v, reading each position of v once, in order (G * d sums in L1)
            float* acc = o.data();
            for (int64_t i = 0; i < G * d; i += VW) vstore(acc + i, vzero());
            for (int64_t l = 0; l < L; l++) {
                const float* vl = vr + l * d;
                for (int64_t g = 0; g < G; g++) {
                    vf pg = _set1(s[g * Lp + l]);
                    float* ag = acc + g * d;
                    for (int64_t e = 0; e < d; e += VW) vstore(ag + e, vfma(pg, vload(vl + e), vload(ag + e)));
                }
            }
            for (int64_t i = 0; i < G * d; i += VW) vstore(out + r * G * d + i, vload(acc + i));
        }
    }
}

// y (M, n) contiguous = x * (1 / sqrt(mean(x^2) + eps)) * w, x rows ldx apart: RMSNorm in
// one read of x and one write of y (torch's CPU rms_norm runs five passes). The order of the
// products is the reference implementation's: (x * r) * w.
void fg_rms_norm_f32(const float* x, int64_t M, int64_t n, int64_t ldx, const float* w, float eps, float* y,
                     int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * n >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * ldx;
        float* ym = y + m * n;
        vf acc = vzero();
        int64_t e = 0;
        for (; e + VW <= n; e += VW) {
            vf v = vload(xm + e);
            acc = vfma(v, v, acc);
        }
        float ss = hsum(acc);
        for (int64_t t = e; t < n; t++) ss += xm[t] * xm[t];
        float r = 1.f / sqrtf(ss / (float)n + eps);
        vf rv = _set1(r);
        for (e = 0; e + VW <= n; e += VW) vstore(ym + e, (vload(xm + e) * rv) * vload(w + e));
        for (int64_t t = e; t < n; t++) ym[t] = (xm[t] * r) * w[t];
    }
}

// g = silu(g) * u in place over n elements, as torch's silu (g / (1 + e^-g)) then mul.
void fg_silu_mul_f32(float* g, const float* u, int64_t n, int nthreads) {
    int64_t nv = n / VW;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 65536)
    for (int64_t b = 0; b < nv; b++) {
        vf x = vload(g + b * VW);
        vstore(g + b * VW, (x / (_set1(1.f) + vexp(-x))) * vload(u + b * VW));
    }
    for (int64_t i = nv * VW; i < n; i++) g[i] = (g[i] / (1.f + expf(-g[i]))) * u[i];
}

// Rotary embedding, rotate-half convention, out of place: x and out (P, H, d) contiguous
// (P positions of H heads), cos and sin (P, d). First half: x1 * c - x2 * s; second half:
// x2 * c + x1 * s; each product rounded before the sum, as x * cos + rotate_half(x) * sin.
void fg_rope_f32(const float* x, int64_t P, int64_t H, int64_t d, const float* cos, const float* sin,
                 float* out, int nthreads) {
    const int64_t h = d / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (P * H * d >= 65536)
    for (int64_t p = 0; p < P; p++) {
        const float* c = cos + p * d;
        const float* s = sin + p * d;
        for (int64_t hd = 0; hd < H; hd++) {
            const float* x1 = x + (p * H + hd) * d;
            const float* x2 = x1 + h;
            float* o1 = out + (p * H + hd) * d;
            float* o2 = o1 + h;
            int64_t e = 0;
            for (; e + VW <= h; e += VW) {
                vf a = vload(x1 + e), b = vload(x2 + e);
                vstore(o1 + e, a * vload(c + e) - b * vload(s + e));
                vstore(o2 + e, b * vload(c + h + e) + a * vload(s + h + e));
            }
            for (; e < h; e++) {
                o1[e] = x1[e] * c[e] - x2[e] * s[e];
                o2[e] = x2[e] * c[h + e] + x1[e] * s[h + e];
            }
        }
    }
}

// Dequantization of group-wise quantized rows (memory/quant.py's QTensor grouped along the
// last dim): element e of row r is code(r, e) * scale[r, e / group] + min[r, e / group], a
// product and a sum each rounded, as the reference computes it. Codes pack 8 / bits per
// byte, low bits first. One pass, one write of the float32 output: torch's unpack, convert,
// multiply and add are five passes over it. bits 4 or 8; 16-element runs inside a group are
// vectorised (groups that are multiples of 16), the rest is scalar.
static inline void dq_store8(float* o, __m128i c8, __m256 s, __m256 m) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8));
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(f, s), m));
}

static inline int dq_code(const uint8_t* c, int64_t e, int bits) {
    return bits == 8 ? c[e] : (c[e >> 1] >> ((e & 1) * 4)) & 15;
}

// Rows are (outer, inner) pairs, n0 x n1 of them, each part with its own two strides (a
// slice of positions of a cache chunk is not one evenly strided run of rows); the output is
// contiguous (n0, n1, cols).
static void dq_row(const uint8_t* c, const float* mn, const float* sc, int64_t cols, int64_t group, int bits,
                   float* o) {
    const int64_t ngroups = (cols + group - 1) / group;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t e0 = g * group, e1 = e0 + group < cols ? e0 + group : cols;
        const float sf = sc[g], mf = mn[g];
        const __m256 s = _mm256_set1_ps(sf), m = _mm256_set1_ps(mf);
        int64_t e = e0;
        if (group % 16 == 0) {
            if (bits == 4) {
                const __m128i lo_mask = _mm_set1_epi8(15);
                for (; e + 16 <= e1; e += 16) {
                    __m128i b = _mm_loadl_epi64((const __m128i*)(c + e / 2));
                    __m128i lo = _mm_and_si128(b, lo_mask);
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo_mask);
                    __m128i q = _mm_unpacklo_epi8(lo, hi);  // 16 codes in element order
                    dq_store8(o + e, q, s, m);
                    dq_store8(o + e + 8, _mm_srli_si128(q, 8), s, m);
                }
            } else if (bits == 8) {
                for (; e + 16 <= e1; e += 16) {
                    __m128i q = _mm_loadu_si128((const __m128i*)(c + e));
                    dq_store8(o + e, q, s, m);
                    dq_store8(o + e + 8, _mm_srli_si128(q, 8), s, m);
                }
            }
        }
        for (; e < e1; e++) o[e] = (float)dq_code(c, e, bits) * sf + mf;
    }
}

// Rows are (outer, inner) pairs, n0 x n1 of them, each part with its own two strides (a
// slice of positions of a cache chunk is not one evenly strided run of rows); the output is
// contiguous (n0, n1, cols).
void fg_dequant_f32(const uint8_t* codes, int64_t n0, int64_t n1, int64_t cols, int64_t c0, int64_t c1,
                    const float* mins, const float* scales, int64_t m0, int64_t m1, int64_t group, int bits,
                    float* out, int nthreads) {
    const int64_t rows = n0 * n1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t a = r / n1, b = r % n1;
        dq_row(codes + a * c0 + b * c1, mins + a * m0 + b * m1, scales + a * m0 + b * m1, cols, group, bits,
               out + r * cols);
    }
}

}  // extern "C"
