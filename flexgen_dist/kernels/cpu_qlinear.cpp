// Group-wise quantized weights on the CPU, in the compute dtype (float32, bfloat16, float16):
//
// qlinear: y = x @ dequant(W).T (+ bias) (+ residual) for few rows of x (a decode step), with
// W's packed 4- or 8-bit codes and its per-group mins and scales read as they are stored: a
// panel of weight rows is expanded into a small per-thread buffer that stays in the core's
// caches and is multiplied there, so no weight-sized dense copy is ever written or read back.
// The weight's bytes are read once, at a quarter (4-bit) of the dense size.
//
// dequant: the same expansion into a dense tensor of the compute dtype in one pass (a prefill
// GEMM of many rows runs on the BLAS; KV cache chunks before their attention).
//
// A 4-bit table format (``table``: 16 float32 values) reads each code as table[code] and has no
// mins: element e is table[code] * fp32(scale) (+ 0), rounded to the compute dtype.
//
// Values are those of the reference expansion: element e of row r is
// fp32(code) * fp32(scale) + fp32(min), a product and a sum each rounded in float32, then
// rounded to the compute dtype (round to nearest even), as ``memory/quant.py`` computes
// ``(codes.float() * scales.float() + mins.float()).to(dtype)``. Products are accumulated in
// float32 and the output is rounded once, then the bias and then the residual are added with
// one rounding each, as ``F.linear(x, w).add_(b).add_(residual)`` rounds in a half dtype.
//
// float32: the panel is expanded to float32 and multiplied by linear_f32's own register blocks
// (cpu_simd.h), so the result equals dequant_f32 followed by linear_f32 bit for bit.
// bfloat16 on a CPU with AVX512_BF16: the panel is expanded to bfloat16 and multiplied with
// VDPBF16PS (32 products per instruction, float32 accumulation; each bfloat16 product is exact
// in float32). Elsewhere (bfloat16 without AVX512_BF16, float16): x is widened to float32 once,
// the panel holds the dtype-rounded values widened to float32, and the float32 blocks run.
//
// Every output element is computed by one thread, in an order that does not depend on the
// number of threads: results are the same at any thread count.
#include <cmath>
#include "cpu_simd.h"

static inline float load_as_f32(const void* p, int64_t i, int dt) {
    switch (dt) {
        case DT_BF16: return bf16_to_f32(((const uint16_t*)p)[i]);
        case DT_F16: return f16_to_f32(((const uint16_t*)p)[i]);
        default: return ((const float*)p)[i];
    }
}

static inline void store_from_f32(void* p, int64_t i, float v, int dt) {
    switch (dt) {
        case DT_BF16: ((uint16_t*)p)[i] = f32_to_bf16(v); break;
        case DT_F16: ((uint16_t*)p)[i] = f32_to_f16(v); break;
        default: ((float*)p)[i] = v;
    }
}

static inline __m256 dq8(__m128i c8, __m256 s, __m256 m, int dt) {
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8));
    return round8(_mm256_add_ps(_mm256_mul_ps(f, s), m), dt);
}

// Eight 4-bit codes' table values (tlo: entries 0-7, thi: 8-15) times s (+ m, 0: no mins).
static inline __m256 dq8t(__m128i c8, __m256 s, __m256 m, __m256 tlo, __m256 thi, int dt) {
    const __m256i idx = _mm256_cvtepu8_epi32(c8);
    const __m256 lo = _mm256_permutevar8x32_ps(tlo, idx), hi = _mm256_permutevar8x32_ps(thi, idx);
    const __m256 f = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
    return round8(_mm256_add_ps(_mm256_mul_ps(f, s), m), dt);
}

static inline int q_code(const uint8_t* c, int64_t e, int bits) {
    return bits == 8 ? c[e] : (c[e >> 1] >> ((e & 1) * 4)) & 15;
}

// Columns [k0, k1) of one quantized row, expanded and rounded to the dtype ``rt``, as float32
// into o[0 .. k1 - k0). Runs of 16 inside a group are vectorised (k0 and the group a multiple
// of 16); the rest is scalar. ``table``: a 4-bit table format's values (mins unread), or null.
static void dq_cols(const uint8_t* c, const void* mn, const void* sc, int mt, int64_t k0, int64_t k1,
                    int64_t group, int bits, int rt, float* o, const float* table = nullptr) {
    const __m256 tlo = table ? _mm256_loadu_ps(table) : _mm256_setzero_ps();
    const __m256 thi = table ? _mm256_loadu_ps(table + 8) : _mm256_setzero_ps();
    int64_t e = k0;
    while (e < k1) {
        const int64_t g = e / group, ge = (g + 1) * group < k1 ? (g + 1) * group : k1;
        const float sf = load_as_f32(sc, g, mt), mf = table ? 0.0f : load_as_f32(mn, g, mt);
        const __m256 s = _mm256_set1_ps(sf), m = _mm256_set1_ps(mf);
        if (e % 16 == 0) {
            if (bits == 4) {
                const __m128i lo_mask = _mm_set1_epi8(15);
                for (; e + 16 <= ge; e += 16) {
                    __m128i b = _mm_loadl_epi64((const __m128i*)(c + e / 2));
                    __m128i lo = _mm_and_si128(b, lo_mask);
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), lo_mask);
                    __m128i q = _mm_unpacklo_epi8(lo, hi);  // 16 codes in element order
                    if (table) {
                        _mm256_storeu_ps(o + e - k0, dq8t(q, s, m, tlo, thi, rt));
                        _mm256_storeu_ps(o + e - k0 + 8, dq8t(_mm_srli_si128(q, 8), s, m, tlo, thi, rt));
                        continue;
                    }
                    _mm256_storeu_ps(o + e - k0, dq8(q, s, m, rt));
                    _mm256_storeu_ps(o + e - k0 + 8, dq8(_mm_srli_si128(q, 8), s, m, rt));
                }
            } else if (bits == 8) {
                for (; e + 16 <= ge; e += 16) {
                    __m128i q = _mm_loadu_si128((const __m128i*)(c + e));
                    _mm256_storeu_ps(o + e - k0, dq8(q, s, m, rt));
                    _mm256_storeu_ps(o + e - k0 + 8, dq8(_mm_srli_si128(q, 8), s, m, rt));
                }
            }
        }
        for (; e < ge; e++) {
            float v = (table ? table[q_code(c, e, bits)] : (float)q_code(c, e, bits)) * sf + mf;
            o[e - k0] = rt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : rt == DT_F16 ? f16_to_f32(f32_to_f16(v)) : v;
        }
    }
}

// A per-thread scratch buffer, grown as needed and kept for the next call.
static float* scratch(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// The float32 output of a half-dtype product rounded as the reference rounds: y, then + bias,
// then + residual, each rounded to the dtype.
static inline float finish(float acc, const void* bias, const void* res, int64_t n, int64_t rm, int dt) {
    float y = acc;
    if (dt != DT_F32) {
        uint16_t h = dt == DT_BF16 ? f32_to_bf16(y) : f32_to_f16(y);
        y = dt == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        if (bias) {
            float v = y + load_as_f32(bias, n, dt);
            y = dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
        }
        if (res) y = y + load_as_f32(res, rm, dt);  // rounded by the store
    }
    return y;
}

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
// The bfloat16 product works on 32-column chunks in a "split" order: the chunk's even columns
// in its first 16 words, its odd columns in the last 16 (the order in which a chunk of 4-bit
// codes, low nibble = even column, expands without a shuffle). x is put in the same order
// once per call; a dot product does not depend on the order of its terms beyond rounding.

// The sums of the 16 lanes of v0..v3, as one 4-lane vector [sum v0, sum v1, sum v2, sum v3].
static inline __m128 hsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// One block of nb weight rows (bfloat16, row stride ldw) x mb rows of x (row stride ldx) over
// kc columns, added into c (mb, ldc). VDPBF16PS multiplies element pairs (2i, 2i + 1) of both
// operands, so both must be in one column order: the split order of a quantized panel, or the
// natural order of a dense bfloat16 weight (``fg_linear_bf16``). A kc that is not a multiple
// of 32 ends with one masked chunk (dense weights; a panel is padded to 32).
template <int nb, int mb>
static inline void bf_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t kc,
                            float* c, int64_t ldc, Prefetch& pf) {
    __m512 acc[nb][mb];
#pragma GCC unroll 8
    for (int i = 0; i < nb; i++)
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32) {
        pf.next();
        __m512bh wv[nb];
#pragma GCC unroll 8
        for (int i = 0; i < nb; i++) wv[i] = (__m512bh)_mm512_loadu_si512((const void*)(w + i * ldw + k));
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(x + j * ldx + k));
#pragma GCC unroll 8
            for (int i = 0; i < nb; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
        }
    }
    if (k < kc) {  // zeros past the end on both sides: their products add nothing
        const __mmask32 mask = (__mmask32)((1u << (kc - k)) - 1);
        __m512bh wv[nb];
#pragma GCC unroll 8
        for (int i = 0; i < nb; i++) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(w + i * ldw + k));
#pragma GCC unroll 8
        for (int j = 0; j < mb; j++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(x + j * ldx + k));
#pragma GCC unroll 8
            for (int i = 0; i < nb; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < mb; j++) {
        if (nb == 4) {
            __m128 sv = hsum4(acc[0][j], acc[1 % nb][j], acc[2 % nb][j], acc[3 % nb][j]);
            _mm_storeu_ps(c + j * ldc, _mm_add_ps(_mm_loadu_ps(c + j * ldc), sv));
        } else {
#pragma GCC unroll 8
            for (int i = 0; i < nb; i++) c[j * ldc + i] += _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

#ifndef BF_NB
#define BF_NB 4
#define BF_MB 6
#endif

template <int nb, int mb>
struct BfTailM {
    static void run(int64_t r, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t kc,
                    float* c, int64_t ldc, Prefetch& pf) {
        if (r == mb) bf_block<nb, mb>(x, ldx, w, ldw, kc, c, ldc, pf);
        else BfTailM<nb, mb - 1>::run(r, x, ldx, w, ldw, kc, c, ldc, pf);
    }
};
template <int nb>
struct BfTailM<nb, 0> {
    static void run(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                    Prefetch&) {}
};

template <int nb>
static void bf_rows(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t kc,
                    float* c, int64_t ldc, Prefetch& pf) {
    int64_t m = 0;
    for (; m + BF_MB <= M; m += BF_MB) bf_block<nb, BF_MB>(x + m * ldx, ldx, w, ldw, kc, c + m * ldc, ldc, pf);
    if (m < M) BfTailM<nb, BF_MB - 1>::run(M - m, x + m * ldx, ldx, w, ldw, kc, c + m * ldc, ldc, pf);
}

template <int nb>
struct BfTailN {
    static void run(int64_t r, const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* w, int64_t ldw,
                    int64_t kc, float* c, int64_t ldc, Prefetch& pf) {
        if (r == nb) bf_rows<nb>(x, M, ldx, w, ldw, kc, c, ldc, pf);
        else BfTailN<nb - 1>::run(r, x, M, ldx, w, ldw, kc, c, ldc, pf);
    }
};
template <>
struct BfTailN<0> {
    static void run(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                    Prefetch&) {}
};

// Columns [k0, k0 + kc) of one quantized row as bfloat16 in split order (kc a multiple of 32;
// columns at or past K are zero). Whole 32-column chunks inside one group of 4- or 8-bit codes
// expand straight from the codes, and so do those over two groups of 16 (a chunk's even and odd
// columns each hold 8 of either group, lanes 0-7 and 8-15: the scale and min vectors are split
// so); the rest goes through dq_cols.
static void bf_panel_row(const uint8_t* c, const void* mn, const void* sc, int mt, int64_t k0, int64_t kc,
                         int64_t K, int64_t group, int bits, uint16_t* out, float* t, const float* table) {
    const int64_t kend = k0 + kc < K ? k0 + kc : K;
    const __m512 tv = table ? _mm512_loadu_ps(table) : _mm512_setzero_ps();
    auto minv = [&](int64_t g) { return table ? 0.0f : load_as_f32(mn, g, mt); };
    auto chunk = [&](int64_t e, __m512 s, __m512 m) {
        __m512i lo, hi;
        if (bits == 4) {
            __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + e / 2)));
            lo = _mm512_and_si512(d, _mm512_set1_epi32(15));
            hi = _mm512_srli_epi32(d, 4);
        } else {
            __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(c + e)));
            lo = _mm512_and_si512(d, _mm512_set1_epi32(255));
            hi = _mm512_srli_epi32(d, 8);
        }
        const __m512 vlo = table ? _mm512_permutexvar_ps(lo, tv) : _mm512_cvtepi32_ps(lo);
        const __m512 vhi = table ? _mm512_permutexvar_ps(hi, tv) : _mm512_cvtepi32_ps(hi);
        __m512 flo = _mm512_add_ps(_mm512_mul_ps(vlo, s), m);
        __m512 fhi = _mm512_add_ps(_mm512_mul_ps(vhi, s), m);
        _mm512_storeu_si512((void*)(out + (e - k0)), (__m512i)_mm512_cvtne2ps_pbh(fhi, flo));
    };
    int64_t e = k0;
    while (e < kend) {
        const int64_t g = e / group, ge = (g + 1) * group < kend ? (g + 1) * group : kend;
        if (e % 32 == 0 && e + 32 <= ge) {
            const __m512 s = _mm512_set1_ps(load_as_f32(sc, g, mt)), m = _mm512_set1_ps(minv(g));
            for (; e + 32 <= ge; e += 32) chunk(e, s, m);
            continue;
        }
        if (group == 16 && e % 32 == 0 && e + 32 <= kend) {
            const __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(load_as_f32(sc, g, mt)),
                                                  _mm512_set1_ps(load_as_f32(sc, g + 1, mt)));
            const __m512 m = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(minv(g)), _mm512_set1_ps(minv(g + 1)));
            chunk(e, s, m);
            e += 32;
            continue;
        }
        // a piece of a chunk: expanded to float32 (rounded to bfloat16), placed in split order
        const int64_t pe = ge < (e / 32 + 1) * 32 ? ge : (e / 32 + 1) * 32;
        dq_cols(c, mn, sc, mt, e, pe, group, bits, DT_BF16, t, table);
        for (int64_t f = e; f < pe; f++) {
            const int64_t o = f - k0, base = o & ~(int64_t)31, r = o & 31;
            out[base + (r & 1 ? 16 + r / 2 : r / 2)] = f32_to_bf16(t[f - e]);
        }
        e = pe;
    }
    for (int64_t f = kend; f < k0 + kc; f++) {
        const int64_t o = f - k0, base = o & ~(int64_t)31, r = o & 31;
        out[base + (r & 1 ? 16 + r / 2 : r / 2)] = 0;
    }
}

// x (M, K) bfloat16 into split order, zero-padded to kp columns (a multiple of 32).
static void bf_split_x(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, int64_t kp, uint16_t* xp) {
    alignas(64) static const uint16_t idx[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const __m512i perm = _mm512_load_si512((const void*)idx);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xm = x + m * ldx;
        uint16_t* o = xp + m * kp;
        for (int64_t k = 0; k < kp; k += 32) {
            const int64_t n = K - k >= 32 ? 32 : (K > k ? K - k : 0);
            const __mmask32 mask = n == 32 ? 0xffffffffu : (__mmask32)((1u << n) - 1);
            __m512i v = _mm512_maskz_loadu_epi16(mask, (const void*)(xm + k));
            _mm512_storeu_si512((void*)(o + k), _mm512_permutexvar_epi16(perm, v));
        }
    }
}
#else
#define HAVE_DPBF16 0
#endif

extern "C" void fg_panel_f32(int64_t nr, const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw,
                             int64_t K, const float* bias, const float* res, float* y, int64_t ldy);

#ifndef QP_ROWS
#define QP_ROWS 32   // weight rows per panel (bfloat16 path)
#define QP_COLS 2048 // columns per panel pass (bfloat16 path): 32 x 2048 x 2 B = 128 KiB, in L2
#endif

extern "C" {

int fg_has_dpbf16(void) { return HAVE_DPBF16; }

// Rows of group-wise quantized codes expanded into the dtype ``ot`` in one pass: codes (n0,
// n1) rows of ``packed`` bytes at strides (c0, c1), mins/scales of dtype ``mt`` at strides (m0,
// m1), each row ``cols`` elements in groups of ``group``; out contiguous (n0, n1, cols).
// ``table``: a 4-bit table format's 16 values (mins not read), or null.
void fg_dequant(const uint8_t* codes, int64_t n0, int64_t n1, int64_t cols, int64_t c0, int64_t c1,
                const void* mins, const void* scales, int64_t m0, int64_t m1, int mt, int64_t group, int bits,
                void* out, int ot, int nthreads, const float* table) {
    const int64_t rows = n0 * n1;
    const int esz = mt == DT_F32 ? 4 : 2, osz = ot == DT_F32 ? 4 : 2;
#pragma omp parallel num_threads(nthreads) if (rows * cols >= 65536)
    {
        static thread_local std::vector<float> tmp;
        float* t = scratch(tmp, (size_t)cols);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t a = r / n1, b = r % n1;
            const char* mn = (const char*)mins + (a * m0 + b * m1) * esz;
            const char* sc = (const char*)scales + (a * m0 + b * m1) * esz;
            char* o = (char*)out + r * cols * osz;
            if (ot == DT_F32) {
                dq_cols(codes + a * c0 + b * c1, mn, sc, mt, 0, cols, group, bits, DT_F32, (float*)o, table);
                continue;
            }
            dq_cols(codes + a * c0 + b * c1, mn, sc, mt, 0, cols, group, bits, ot, t, table);
            uint16_t* oh = (uint16_t*)o;
            int64_t e = 0;
            if (ot == DT_BF16) {  // already rounded: the high halves are the bfloat16 values
                for (; e + 8 <= cols; e += 8) {
                    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(_mm256_loadu_ps(t + e)), 16);
                    __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
                    _mm_storeu_si128((__m128i*)(oh + e), p);
                }
            } else {
                for (; e + 8 <= cols; e += 8)
                    _mm_storeu_si128((__m128i*)(oh + e), _mm256_cvtps_ph(_mm256_loadu_ps(t + e), _MM_FROUND_TO_NEAREST_INT));
            }
            for (; e < cols; e++) store_from_f32(oh, e, t[e], ot);
        }
    }
}

// The float value of each FP8 e4m3 (fn) byte: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 subnormal, 0x7f / 0xff NaN (no infinities): torch's float8_e4m3fn values.
static const float* e4m3_values() {
    static float lut[256];
    static bool made = false;
    if (!made) {
        for (int b = 0; b < 256; b++) {
            const int e = (b >> 3) & 15, m = b & 7;
            float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
            if (e == 15 && m == 7) v = std::nanf("");
            lut[b] = (b & 0x80) ? -v : v;
        }
        made = true;
    }
    return lut;
}

// Rows of FP8 codes expanded into the dtype ``ot``: codes (rows, >= groups * group bytes; row
// stride ldc), float32 scales (rows, groups; row stride lds), each element fp8(code) * its
// group's scale in float32, rounded to ``ot``; out contiguous (rows, cols).
void fg_dequant_fp8(const uint8_t* codes, int64_t rows, int64_t cols, int64_t ldc, const float* scales,
                    int64_t lds, int64_t group, void* out, int ot, int nthreads) {
    const float* lut = e4m3_values();
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t* c = codes + r * ldc;
        const float* sc = scales + r * lds;
        for (int64_t g0 = 0; g0 < cols; g0 += group) {
            const float s = sc[g0 / group];
            const int64_t g1 = g0 + group < cols ? g0 + group : cols;
            if (ot == DT_F32) {
                float* o = (float*)out + r * cols;
                for (int64_t e = g0; e < g1; e++) o[e] = lut[c[e]] * s;
            } else if (ot == DT_BF16) {
                uint16_t* o = (uint16_t*)out + r * cols;
                for (int64_t e = g0; e < g1; e++) o[e] = f32_to_bf16(lut[c[e]] * s);
            } else {
                uint16_t* o = (uint16_t*)out + r * cols;
                for (int64_t e = g0; e < g1; e++) o[e] = f32_to_f16(lut[c[e]] * s);
            }
        }
    }
}

// y (M, N; row stride ldy, dtype dt) = x (M, K; row stride ldx, dtype dt) @ W.T (+ bias (N))
// (+ res (M, N; row stride ldy)), W (N, K) given as codes (row stride ldc bytes), mins and
// scales (N, groups; row stride ldm, dtype mt), groups of ``group`` along K, ``bits`` 4 or 8.
// xf: a scratch of M x K float32 (or M x round_up(K, 32) bfloat16 for the native bfloat16 product,
// which runs where the CPU has it and native_bf16 is set). ``table``: a 4-bit table format's 16
// values (the mins are not read; scales float32), or null.
void fg_qlinear(const void* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes, int64_t ldc,
                const void* mins, const void* scales, int64_t ldm, int mt, int64_t N, int64_t group, int bits,
                const void* bias, const void* res, void* y, int64_t ldy, int dt, float* xf, int native_bf16,
                int nthreads, const float* table) {
    const int esz = mt == DT_F32 ? 4 : 2;
#if HAVE_DPBF16
    if (dt == DT_BF16 && native_bf16) {
        const int64_t kp = (K + 31) / 32 * 32;
        const int64_t kcap = kp < QP_COLS ? kp : QP_COLS;
        const int64_t npan = (N + QP_ROWS - 1) / QP_ROWS;
        uint16_t* xp = (uint16_t*)xf;  // the caller's scratch: M x kp bfloat16
        bf_split_x((const uint16_t*)x, M, K, ldx, kp, xp);
#pragma omp parallel num_threads(nthreads)
        {
            static thread_local std::vector<float> pbuf, cbuf, tbuf;
            uint16_t* panel = (uint16_t*)scratch(pbuf, (size_t)(QP_ROWS * kcap / 2));
            float* c = scratch(cbuf, (size_t)(M * QP_ROWS));
            float* t = scratch(tbuf, 32);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < npan; p++) {
                const int64_t n0 = p * QP_ROWS, nr = N - n0 < QP_ROWS ? N - n0 : QP_ROWS;
                memset(c, 0, sizeof(float) * M * QP_ROWS);
                for (int64_t k0 = 0; k0 < kp; k0 += kcap) {
                    const int64_t kc = kp - k0 < kcap ? kp - k0 : kcap;  // a multiple of 32
                    for (int64_t r = 0; r < nr; r++) {
                        const int64_t n = n0 + r;
                        bf_panel_row(codes + n * ldc, (const char*)mins + n * ldm * esz,
                                     (const char*)scales + n * ldm * esz, mt, k0, kc, K, group, bits,
                                     panel + r * kcap, t, table);
                    }
                    Prefetch none{nullptr, nullptr, 0};  // the panel is in cache: it was just written
                    for (int64_t r0 = 0; r0 < nr; r0 += BF_NB)
                        BfTailN<BF_NB>::run(nr - r0 < BF_NB ? nr - r0 : BF_NB, xp + k0, M, kp, panel + r0 * kcap,
                                            kcap, kc, c + r0, QP_ROWS, none);
                }
                for (int64_t m = 0; m < M; m++)
                    for (int64_t r = 0; r < nr; r++)
                        store_from_f32(y, m * ldy + n0 + r, finish(c[m * QP_ROWS + r], bias, res, n0 + r, m * ldy + n0 + r, dt), dt);
            }
        }
        return;
    }
#endif
    // float32 products over a float32 panel: linear_f32's register blocks.
    const float* xs = (const float*)x;
    int64_t ldxs = ldx;
    if (dt != DT_F32) {  // widen x once (exact)
        for (int64_t m = 0; m < M; m++) {
            const uint16_t* xm = (const uint16_t*)x + m * ldx;
            float* o = xf + m * K;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                __m128i h = _mm_loadu_si128((const __m128i*)(xm + k));
                _mm256_storeu_ps(o + k, dt == DT_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                                      : _mm256_cvtph_ps(h));
            }
            for (; k < K; k++) o[k] = load_as_f32(xm, k, dt);
        }
        xs = xf;
        ldxs = K;
    }
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(nthreads)
    {
        static thread_local std::vector<float> pbuf, ybuf;
        float* panel = scratch(pbuf, (size_t)(NB * K));
        float* yt = dt == DT_F32 ? nullptr : scratch(ybuf, (size_t)(M * NB));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * NB, nr = N - n0 < NB ? N - n0 : NB;
            for (int64_t r = 0; r < nr; r++)
                dq_cols(codes + (n0 + r) * ldc, (const char*)mins + (n0 + r) * ldm * esz,
                        (const char*)scales + (n0 + r) * ldm * esz, mt, 0, K, group, bits, dt, panel + r * K, table);
            if (dt == DT_F32) {
                fg_panel_f32(nr, xs, M, ldxs, panel, K, K, bias ? (const float*)bias + n0 : nullptr,
                             res ? (const float*)res + n0 : nullptr, (float*)y + n0, ldy);
                continue;
            }
            fg_panel_f32(nr, xs, M, ldxs, panel, K, K, nullptr, nullptr, yt, NB);
            for (int64_t m = 0; m < M; m++)
                for (int64_t r = 0; r < nr; r++)
                    store_from_f32(y, m * ldy + n0 + r, finish(yt[m * NB + r], bias, res, n0 + r, m * ldy + n0 + r, dt), dt);
        }
    }
}

// y (M, N; row stride ldy) = x (M, K; row stride ldx) @ w.T (+ bias (N)) (+ res (M, N; row
// stride ldy)), all bfloat16, w (N, K) row-major with row stride ldw: the dense product of few
// rows (a decode step) with VDPBF16PS, each weight row read once from its layout (the BLAS
// repacks the whole weight on every call). Products are exact in float32 and summed there;
// the output is rounded once, then the bias and the residual are added with one rounding
// each (``finish``). Parallel over panels of weight rows; each output element is one
// thread's, in an order that does not depend on the thread count. Returns 0 where the CPU
// has no VDPBF16PS (nothing written), 1 otherwise.
int fg_linear_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, int64_t N, int64_t ldw,
                   const uint16_t* bias, const uint16_t* res, uint16_t* y, int64_t ldy, int nthreads) {
#if HAVE_DPBF16
    const int64_t npan = (N + QP_ROWS - 1) / QP_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        static thread_local std::vector<float> cbuf;
        float* c = scratch(cbuf, (size_t)(M * QP_ROWS));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npan; p++) {
            const int64_t n0 = p * QP_ROWS, nr = N - n0 < QP_ROWS ? N - n0 : QP_ROWS;
            memset(c, 0, sizeof(float) * M * QP_ROWS);
            for (int64_t r0 = 0; r0 < nr; r0 += BF_NB) {
                // the next rows' lines on their way while these compute, spread over the first
                // pass's iterations (cold weights stream from memory)
                const int64_t nx = n0 + r0 + BF_NB, ne = nx + BF_NB < N ? nx + BF_NB : N;
                const char* from = (const char*)(w + nx * ldw);
                const int64_t bytes = ne > nx ? (ne - nx) * ldw * 2 : 0, lines = (bytes + 63) / 64;
                const int64_t iters = (K + 31) / 32;
                Prefetch pf{from, from + bytes, (lines + iters - 1) / iters};
                BfTailN<BF_NB>::run(nr - r0 < BF_NB ? nr - r0 : BF_NB, x, M, ldx, w + (n0 + r0) * ldw, ldw, K,
                                    c + r0, QP_ROWS, pf);
            }
            for (int64_t m = 0; m < M; m++)
                for (int64_t r = 0; r < nr; r++)
                    y[m * ldy + n0 + r] = f32_to_bf16(finish(c[m * QP_ROWS + r], bias, res, n0 + r, m * ldy + n0 + r,
                                                             DT_BF16));
        }
    }
    return 1;
#else
    (void)x; (void)M; (void)K; (void)ldx; (void)w; (void)N; (void)ldw; (void)bias; (void)res; (void)y; (void)ldy;
    (void)nthreads;
    return 0;
#endif
}

}  // extern "C"
