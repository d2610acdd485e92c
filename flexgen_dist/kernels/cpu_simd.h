// Shared by the native CPU kernels (cpu_kernels.cpp, cpu_attention.cpp, cpu_qlinear.cpp,
// cpu_quant.cpp): the
// SIMD vector type of the build (AVX-512 or AVX2 with FMA), its helpers, loads and stores of
// each dtype's vectors widened to float32, a vectorised e^x, and the float32
// register-blocked GEMM of few rows (block / rows / TailM / TailN) that linear_f32 runs and
// the fused 4-bit linear reuses on a dequantized panel of weight rows.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <string.h>

#include <type_traits>
#include <vector>

// dtype codes shared with the Python wrappers, and exact scalar conversions
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's cast
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }


// 8 float32 lanes rounded to the dtype and widened back (the value a dtype tensor holds).
static inline __m256 round8(__m256 v, int dt) {
    if (dt == DT_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
        r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
        // a NaN would round into another NaN or infinity; expanded weights are finite
        return _mm256_castsi256_ps(r);
    }
    if (dt == DT_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}


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
static inline float hmin(vf v) { return _mm512_reduce_min_ps(v); }
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
static inline float hmin(vf v) {
    __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_min_ps(s, _mm_movehl_ps(s, s));
    s = _mm_min_ss(s, _mm_shuffle_ps(s, s, 1));
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

// The vector of VW elements at p, widened to float32 (exact): float32, bfloat16 or float16.
template <int DT>
static inline vf vload_as_f32(const void* p) {
    if (DT == DT_F32) return vload((const float*)p);
#if VW == 16
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    if (DT == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
#else
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    if (DT == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
#endif
}

// v rounded to the dtype DT (round to nearest even), as float32; and stored in DT at p. A
// bfloat16 NaN whose payload sits only in the low 16 bits would round to infinity here
// (activations that reach this are finite in practice; scalar f32_to_bf16 keeps it NaN).
template <int DT>
static inline vf vround(vf v) {
    if (DT == DT_F32) return v;
#if VW == 16
    if (DT == DT_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
#else
    return round8(v, DT);
#endif
}

template <int DT>
static inline void vstore_as(void* p, vf v) {
    if (DT == DT_F32) {
        vstore((float*)p, v);
        return;
    }
#if VW == 16
    if (DT == DT_F16) {
        _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        return;
    }
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vround<DT>(v)), 16)));
#else
    if (DT == DT_F16) {
        _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        return;
    }
    __m256i h = _mm256_srli_epi32(_mm256_castps_si256(vround<DT>(v)), 16);
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
#endif
}

// Scalars of a dtype DT: its element type, one widened to float32, one rounded to DT.
template <int DT>
using Elem = typename std::conditional<DT == DT_F32, float, uint16_t>::type;

template <int DT>
static inline float ld1(const Elem<DT>* p, int64_t i) {
    if constexpr (DT == DT_F32) return p[i];
    else if constexpr (DT == DT_BF16) return bf16_to_f32(p[i]);
    else return f16_to_f32(p[i]);
}

template <int DT>
static inline Elem<DT> to_dt(float v) {
    if constexpr (DT == DT_F32) return v;
    else if constexpr (DT == DT_BF16) return f32_to_bf16(v);
    else return f32_to_f16(v);
}

template <int DT>
static inline float rnd1(float v) {  // v rounded to the dtype, as float32
    if constexpr (DT == DT_F32) return v;
    else if constexpr (DT == DT_BF16) return bf16_to_f32(f32_to_bf16(v));
    else return f16_to_f32(f32_to_f16(v));
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

