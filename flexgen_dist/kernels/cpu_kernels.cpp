// CPU kernels, compiled on first use for the machine that runs them
// (flexgen_dist/kernels/__init__.py builds this file with -O3 -march=native -fopenmp
// -ffp-contract=off). Decode: linear_f32, attention (float32, bfloat16, float16). Every
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
// attention: decode attention of one query position over a KV cache laid out as rows of
// (sequence, kv head), read in place (the engine's row-major chunks, or position-major staged
// disk chunks). The G query heads of a kv head share each row's pass over its keys and values,
// read in order; scores and softmax stay in the core's caches, the weighted sums in registers.
//
// The OpenMP runtime is the process's: torch has libgomp.so.1 loaded before this library,
// and the loader resolves the same soname to it, so both share one thread pool.
#include "cpu_simd.h"

#include <type_traits>

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

// nr (<= NB) weight rows w (row stride ldw) against M rows of x: linear_f32's register blocks,
// for the fused quantized product's float32 panels (cpu_qlinear.cpp), so their template
// instances are compiled once, here.
extern "C" void fg_panel_f32(int64_t nr, const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw,
                             int64_t K, const float* bias, const float* res, float* y, int64_t ldy) {
    Prefetch pf{nullptr, nullptr, 0};
    TailN<NB>::run(nr, x, M, ldx, w, ldw, K, bias, res, y, ldy, pf);
}

// Within each 128-bit unit: interleaved floats (unpack_lo/hi) and pairs of floats (unpack_lo2/hi2).
#if VW == 16
#define FG_V(op) _mm512_##op
#else
#define FG_V(op) _mm256_##op
#endif
static inline vf unpack_lo(vf x, vf y) { return FG_V(unpacklo_ps)(x, y); }
static inline vf unpack_hi(vf x, vf y) { return FG_V(unpackhi_ps)(x, y); }
static inline vf unpack_lo2(vf x, vf y) {
    return FG_V(castpd_ps)(FG_V(unpacklo_pd)(FG_V(castps_pd)(x), FG_V(castps_pd)(y)));
}
static inline vf unpack_hi2(vf x, vf y) {
    return FG_V(castpd_ps)(FG_V(unpackhi_pd)(FG_V(castps_pd)(x), FG_V(castps_pd)(y)));
}
#undef FG_V

// VW accumulators summed across their lanes at once: lane i of the result is hsum(a[i]), added
// in hsum's own order (the halves of the vector, then the quarters, then within 128 bits: (x0 +
// x2) + (x1 + x3)), so each sum is bit for bit one hsum's; the transposes share their shuffles
// among the VW sums (about 3 operations a sum instead of 8).
static inline vf hsums(const vf* a) {
#if VW == 16
    auto halves = [](vf x, vf y) {  // 128-bit units [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
        return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    };
    auto quarters = [](vf x, vf y) {  // units [x0 + x1, x2 + x3, y0 + y1, y2 + y3]
        return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    };
    // z[i]'s unit j holds a[4j + i]'s four partial sums
    vf z[4];
    for (int i = 0; i < 4; i++) z[i] = quarters(halves(a[i], a[4 + i]), halves(a[8 + i], a[12 + i]));
#else
    auto halves = [](vf x, vf y) {  // 128-bit units [x0 + x1, y0 + y1]
        return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    };
    vf z[4];
    for (int i = 0; i < 4; i++) z[i] = halves(a[i], a[4 + i]);
#endif
    // within each 128-bit unit: [z0's x0 + x2, z1's, z0's x1 + x3, z1's], then (x0 + x2) + (x1 + x3)
    vf u0 = unpack_lo(z[0], z[1]) + unpack_hi(z[0], z[1]);
    vf u1 = unpack_lo(z[2], z[3]) + unpack_hi(z[2], z[3]);
    return unpack_lo2(u0, u1) + unpack_hi2(u0, u1);
}

// lane i of yes where bit i of bits is set, else of no
static inline vf vselect(unsigned bits, vf yes, vf no) {
#if VW == 16
    return _mm512_mask_blend_ps((__mmask16)bits, no, yes);
#else
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane);
    return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(on));
#endif
}

// n positions of a cache row (position l at src + l * ld elements of dtype DT, d contiguous)
// widened to float32 rows of d at dst; the rest of m rows zeroed (a block's last, partial tile).
template <int DT>
static inline void widen_rows(const char* src, int64_t ld, int64_t n, int64_t m, int64_t d, float* dst) {
    const int esz = DT == DT_F32 ? 4 : 2;
    for (int64_t p = 0; p < n; p++)
        for (int64_t e = 0; e < d; e += VW) vstore(dst + p * d + e, vload_as_f32<DT>(src + (p * ld + e) * esz));
    for (int64_t p = n; p < m; p++)
        for (int64_t e = 0; e < d; e += VW) vstore(dst + p * d + e, vzero());
}

// The scores of ht query heads (qf + h * d, float32) against VW / ht positions of a cache row
// (position p's d elements of dtype DT at k + p * ld elements): VW accumulators, lane h * VW / ht
// + p of the result the dot product of head h and position p. Each key vector is read once for
// the ht heads.
template <int DT, int ht>
static inline vf score_tile(const float* qf, const char* k, int64_t ld, int64_t d) {
    constexpr int pt = VW / ht;
    const int esz = DT == DT_F32 ? 4 : 2;
    vf acc[VW];
#pragma GCC unroll 16
    for (int i = 0; i < VW; i++) acc[i] = vzero();
#pragma GCC unroll 16
    for (int p = 0; p < pt; p++) {  // each key row read in order
        const char* kp = k + p * ld * esz;
        for (int64_t e = 0; e < d; e += VW) {
            const vf kv = vload_as_f32<DT>(kp + e * esz);
#pragma GCC unroll 4
            for (int h = 0; h < ht; h++) acc[h * pt + p] = vfma(vload(qf + h * d + e), kv, acc[h * pt + p]);
        }
    }
    return hsums(acc);
}

// The weighted sum of n positions of a cache row's values (position l's d elements of dtype DT
// at v + l * ld elements) into gt query heads' outputs (acc + g * d), ct vectors of each: gt x
// ct accumulators held in registers over all the positions, each value vector read once for the
// gt heads; p: the heads' probabilities, ldp apart. Each output element adds its terms in
// position order, as one head at a time would.
template <int DT, int gt, int ct>
static void value_tile(const char* v, int64_t ld, int64_t n, const float* p, int64_t ldp, float* acc, int64_t d) {
    const int esz = DT == DT_F32 ? 4 : 2;
    vf a[gt][ct];
#pragma GCC unroll 8
    for (int g = 0; g < gt; g++)
#pragma GCC unroll 8
        for (int c = 0; c < ct; c++) a[g][c] = vzero();
    for (int64_t l = 0; l < n; l++) {
        vf x[ct];
#pragma GCC unroll 8
        for (int c = 0; c < ct; c++) x[c] = vload_as_f32<DT>(v + (l * ld + c * VW) * esz);
#pragma GCC unroll 8
        for (int g = 0; g < gt; g++) {
            const vf pg = _set1(p[g * ldp + l]);
#pragma GCC unroll 8
            for (int c = 0; c < ct; c++) a[g][c] = vfma(pg, x[c], a[g][c]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < gt; g++)
#pragma GCC unroll 8
        for (int c = 0; c < ct; c++) vstore(acc + g * d + c * VW, a[g][c]);
}

// Tiles of up to GT heads x CT vectors, at most ACC accumulators: the accumulators, a position's
// vectors and a broadcast stay within the registers (AVX-512: 16 + 8 + 1 of 32; AVX2: 8 + 4 + 1
// of 16, or one head's 8 accumulators with each vector loaded as it is used). A tile spans as
// much of a head as it can, so each pass reads whole value rows in order.
static constexpr int GT = 4;
static constexpr int CT = 8;
static constexpr int ACC = VW == 16 ? 16 : 8;
typedef void (*ValueTile)(const char*, int64_t, int64_t, const float*, int64_t, float*, int64_t);
template <int DT, int g, int c>
struct TileTable {
    static void fill(ValueTile* t) {
        t[(g - 1) * CT + c - 1] = value_tile<DT, g, c>;
        if constexpr (c > 1) TileTable<DT, g, c - 1>::fill(t);
        else if constexpr (g > 1) TileTable<DT, g - 1, CT>::fill(t);
    }
};
template <int DT>
static const ValueTile* value_tiles() {
    static ValueTile t[GT * CT];
    static const bool done = (TileTable<DT, GT, CT>::fill(t), true);
    (void)done;
    return t;
}

// out (R, G, d) = softmax(q k^T * scale, masked) v for each row r, elements of dtype DT
// (float32, bfloat16, float16) with float32 arithmetic throughout and one rounding of the
// output: q (R, G, d) contiguous; position l of row r of k at k + r * ldk + l * ldl (v alike:
// ldv, ldvl), positions [0, L) (a row-major chunk has ldl = d, a position-major staged disk
// chunk ldl = rows * d); mask (R, L) with row stride ldm (nonzero = visible; every row must
// see at least one position). d must be a multiple of the vector width. sinks (R, G) float32,
// or null: a logit per query head that joins the softmax's denominator only (gpt-oss). lse
// (R, G) float32, or null: each query head's log-sum-exp of its scores (the sink's included),
// for merging with attention over other keys (a shared prefix held once); out is then float32
// whatever DT, so the merge rounds once.
//
// Scores in tiles of a pair of heads (an odd last one alone) x VW / 2 positions (VW alone),
// each key vector read from the row, in order, once for the pair (score_tile; a last partial
// tile from a zero-padded widened copy), the tile's VW sums reduced together (hsums); the
// weighted sum of values in register tiles of heads x vectors over all the positions
// (value_tile). Every score and output is added in the order of a plain loop of one hsum per
// score and one fma per position and head, so the results do not depend on the tiling.
template <int DT>
static void attention(const void* q, int64_t R, int64_t G, int64_t d, const void* k, int64_t ldk, int64_t ldl,
                      const void* v, int64_t ldv, int64_t ldvl, int64_t L, const uint8_t* mask, int64_t ldm,
                      const float* sinks, float scale, void* out, float* lse, int nthreads) {
    const int esz = DT == DT_F32 ? 4 : 2;
    const ValueTile* tiles = value_tiles<DT>();
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t Lp = (L + VW - 1) / VW * VW;  // each head's scores padded with -inf
        std::vector<float> s((size_t)(G * Lp)), o((size_t)(G * d)), qf((size_t)(G * d)), tail((size_t)(VW * d));
        alignas(64) float sums[VW];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const char* qr = (const char*)q + r * G * d * esz;
            for (int64_t i = 0; i < G * d; i += VW) vstore(qf.data() + i, vload_as_f32<DT>(qr + i * esz));
            const char* kr = (const char*)k + r * ldk * esz;
            const char* vr = (const char*)v + r * ldv * esz;
            const uint8_t* mr = mask + r * ldm;
            const vf ninf = _set1(-INFINITY), sc = _set1(scale);
            for (int64_t g = 0; g < G; g++)  // the softmax below overwrites the padding
                for (int64_t l = L; l < Lp; l++) s[g * Lp + l] = -INFINITY;
            for (int64_t g = 0; g < G; g += 2) {  // pairs of heads share each key read; an odd one alone
                const bool two = g + 1 < G;
                const int64_t pt = two ? VW / 2 : VW;  // positions per tile
                const float* qg = qf.data() + g * d;
                for (int64_t l0 = 0; l0 < L; l0 += pt) {
                    const int64_t n = L - l0 < pt ? L - l0 : pt;
                    unsigned bits = 0;
                    for (int64_t i = 0; i < n; i++) bits |= (unsigned)(mr[l0 + i] != 0) << i;
                    vf x;
                    if (n < pt) {  // the last, partial tile: its keys widened and zero-padded
                        widen_rows<DT>(kr + l0 * ldl * esz, ldl, n, pt, d, tail.data());
                        const char* t = (const char*)tail.data();
                        x = two ? score_tile<DT_F32, 2>(qg, t, d, d) : score_tile<DT_F32, 1>(qg, t, d, d);
                    } else {
                        const char* kl = kr + l0 * ldl * esz;
                        x = two ? score_tile<DT, 2>(qg, kl, ldl, d) : score_tile<DT, 1>(qg, kl, ldl, d);
                    }
                    x = vselect(two ? bits | bits << pt : bits, x * sc, ninf);
                    if (!two) {
                        vstore(s.data() + g * Lp + l0, x);
                    } else {
                        vstore(sums, x);
                        memcpy(s.data() + g * Lp + l0, sums, pt * 4);
                        memcpy(s.data() + (g + 1) * Lp + l0, sums + pt, pt * 4);
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float* sg = s.data() + g * Lp;
                vf mv = _set1(-INFINITY);
                for (int64_t l = 0; l < Lp; l += VW) mv = vmax(mv, vload(sg + l));
                float m = hmax(mv);
                const float sink = sinks ? sinks[r * G + g] : -INFINITY;
                if (sink > m) m = sink;
                vf mx = _set1(m), sv = vzero();
                for (int64_t l = 0; l < Lp; l += VW) {
                    vf e = vexp(vload(sg + l) - mx);
                    vstore(sg + l, e);
                    sv = sv + e;
                }
                const float sum = hsum(sv) + (sinks ? expf(sink - m) : 0.f);
                if (lse) lse[r * G + g] = m + logf(sum);
                vf inv = _set1(1.f / sum);
                for (int64_t l = 0; l < Lp; l += VW) vstore(sg + l, vload(sg + l) * inv);
            }
            // out = p v in tiles of heads x vectors, each over all the positions
            float* acc = o.data();
            const int64_t nv = d / VW;
            const int64_t cmax = G > 1 && CT > ACC / 2 ? ACC / 2 : CT;  // two heads a tile where there are two
            const int64_t cw = nv < cmax ? nv : cmax;  // vectors of a tile
            const int64_t gw = ACC / cw < GT ? ACC / cw : GT;  // heads of a tile
            for (int64_t g = 0; g < G; g += gw) {
                const int64_t gt = G - g < gw ? G - g : gw;
                for (int64_t c = 0; c < nv; c += cw) {
                    const int64_t ct = nv - c < cw ? nv - c : cw;
                    tiles[(gt - 1) * CT + ct - 1](vr + c * VW * esz, ldvl, L, s.data() + g * Lp, Lp,
                                                  acc + g * d + c * VW, d);
                }
            }
            if (DT == DT_F32 || lse) {  // with lse: float32 out, rounded once after the merge
                for (int64_t i = 0; i < G * d; i += VW) vstore((float*)out + r * G * d + i, vload(acc + i));
            } else {
                uint16_t* oh = (uint16_t*)out + r * G * d;
                for (int64_t i = 0; i < G * d; i++) oh[i] = DT == DT_BF16 ? f32_to_bf16(acc[i]) : f32_to_f16(acc[i]);
            }
        }
    }
}

// The elementwise kernels below take float32, bfloat16 or float16 (DT) and compute in float32,
// rounding to the dtype exactly where torch's own path for that dtype rounds (for float32 the
// roundings are no-ops, and the float32 kernels are these same templates). T is the element.
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

// fg_attention for a dtype code dt (0 float32, 1 bfloat16, 2 float16); see attention above.
void fg_attention(const void* q, int64_t R, int64_t G, int64_t d, const void* k, int64_t ldk, int64_t ldl,
                  const void* v, int64_t ldv, int64_t ldvl, int64_t L, const uint8_t* mask, int64_t ldm,
                  const float* sinks, float scale, void* out, float* lse, int dt, int nthreads) {
    if (dt == DT_BF16)
        attention<DT_BF16>(q, R, G, d, k, ldk, ldl, v, ldv, ldvl, L, mask, ldm, sinks, scale, out, lse, nthreads);
    else if (dt == DT_F16)
        attention<DT_F16>(q, R, G, d, k, ldk, ldl, v, ldv, ldvl, L, mask, ldm, sinks, scale, out, lse, nthreads);
    else attention<DT_F32>(q, R, G, d, k, ldk, ldl, v, ldv, ldvl, L, mask, ldm, sinks, scale, out, lse, nthreads);
}

// The elementwise kernels for a dtype code dt (0 float32, 1 bfloat16, 2 float16), as
// fg_attention; see rms_norm, silu_mul and rope above.
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
