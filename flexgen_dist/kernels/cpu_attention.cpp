// Decode attention on the CPU, compiled with the other native kernels (cpu_kernels.cpp's
// flags): one query position per head over a KV cache laid out as rows of (sequence, kv head),
// read in place (the engine's row-major chunks, or position-major staged disk chunks), stored
// in the dtype (fg_attention) or as group-wise 4- or 8-bit codes (fg_attention_packed, a
// compressed cache: each value expanded in registers as it is read, never written back). The G
// query heads of a kv head share each row's pass over its keys and values, read in order;
// scores and softmax stay in the core's caches, the weighted sums in registers.
#include "cpu_simd.h"

#include <type_traits>

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

// A cache's keys or values as the kernel reads them: ``row(r)`` the same source moved to row r,
// ``at(l)`` to position l of its row; ``load(l, e)`` the VW elements [e, e + VW) of position l
// of that row, as float32. A ``grouped`` source also reads a group of ``group`` elements at a
// time: ``prep(l, e)`` what the group from element e of position l shares (prepared once),
// ``get(prep, l, e)`` one of its vectors.

// Elements of dtype DT: position l of row r at p + r * ldr + l * ldl elements, d contiguous.
template <int DT>
struct Dense {
    static constexpr int esz = DT == DT_F32 ? 4 : 2;
    static constexpr int heads = 2;  // query heads a score tile takes at most
    static constexpr bool heads_first = false;  // value tiles: as much of a head as they hold
    static constexpr bool grouped = false;
    const char* p;
    int64_t ldr, ldl;
    Dense row(int64_t r) const { return {p + r * ldr * esz, 0, ldl}; }
    Dense at(int64_t l) const { return {p + l * ldl * esz, 0, ldl}; }
    vf load(int64_t l, int64_t e) const { return vload_as_f32<DT>(p + (l * ldl + e) * esz); }
};

// VW codes of BITS (4: two a byte, the low nibble first; 8) from b, as float32.
template <int BITS>
static inline vf codes_f32(const uint8_t* b) {
    __m128i x;
    if (BITS == 8) {
        x = VW == 16 ? _mm_loadu_si128((const __m128i*)b) : _mm_loadl_epi64((const __m128i*)b);
    } else {
        __m128i y;
        if (VW == 16) {
            y = _mm_loadl_epi64((const __m128i*)b);
        } else {
            int32_t w;
            memcpy(&w, b, 4);
            y = _mm_cvtsi32_si128(w);
        }
        const __m128i lo_mask = _mm_set1_epi8(15);
        x = _mm_unpacklo_epi8(_mm_and_si128(y, lo_mask), _mm_and_si128(_mm_srli_epi16(y, 4), lo_mask));
    }
#if VW == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
#endif
}

// Group-wise codes of BITS (memory/quant.py's layout, grouped along d): position l of row r's
// codes at c + r * cr + l * cl bytes, its groups' minimums and scales (dtype DT) at mn / sc + r *
// mr + l * ml elements; gi[i] the group of the vector [i * VW, (i + 1) * VW) (groups hold whole
// vectors). Each value is code * scale + min in float32, rounded to DT: what the expansion
// (fg_dequant) stores, so attention over the codes equals attention over the expanded cache.
template <int DT, int BITS>
struct Packed {
    static constexpr int esz = DT == DT_F32 ? 4 : 2;
    // each vector read costs its expansion: tiles of more heads share it (scores of 4 heads x
    // VW / 4 positions; value tiles of as many heads as they hold, fewer vectors of each)
    static constexpr int heads = 4;
    static constexpr bool heads_first = true;
    static constexpr bool grouped = true;
    // 4-bit codes: a group's 16 values, each code * scale + min rounded to DT, in one vector
    // (AVX-512) or two (AVX2, for a half dtype: float32 needs no rounding, so its product and sum
    // cost less than two permutes and a blend), each code a lane index into them (a permute a
    // vector instead of a conversion, a product, a sum and a rounding); elsewhere the scale and
    // min, broadcast once a group
    static constexpr bool table = BITS == 4 && (VW == 16 || DT != DT_F32);
    const uint8_t* c;
    int64_t cr, cl;
    const char* mn;
    const char* sc;
    int64_t mr, ml;
    const int32_t* gi;
    int64_t group;
    Packed row(int64_t r) const {
        return {c + r * cr, 0, cl, mn + r * mr * esz, sc + r * mr * esz, 0, ml, gi, group};
    }
    Packed at(int64_t l) const {
        return {c + l * cl, 0, cl, mn + l * ml * esz, sc + l * ml * esz, 0, ml, gi, group};
    }
    struct Prep {
        vf a, b;  // the table (a; AVX2: codes 0-7 in a, 8-15 in b), or the scale (a) and the min (b)
    };
    Prep prep(int64_t l, int64_t e) const {
        const int64_t g = l * ml + gi[e / VW];
        const vf s = _set1(ld1<DT>((const Elem<DT>*)sc, g)), m = _set1(ld1<DT>((const Elem<DT>*)mn, g));
        if constexpr (table) {
#if VW == 16
            const vf codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            return {vround<DT>(codes * s + m), m};
#else
            const vf lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
            return {vround<DT>(lo * s + m), vround<DT>(hi * s + m)};
#endif
        }
        return {s, m};
    }
    vf get(const Prep& t, int64_t l, int64_t e) const {
        const uint8_t* b = c + l * cl + e * BITS / 8;
        if constexpr (table) {
#if VW == 16
            const __m128i y = _mm_loadl_epi64((const __m128i*)b), lo_mask = _mm_set1_epi8(15);
            const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(y, lo_mask), _mm_and_si128(_mm_srli_epi16(y, 4), lo_mask));
            return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(x), t.a);
#else
            int32_t w;
            memcpy(&w, b, 4);
            const __m128i y = _mm_cvtsi32_si128(w), lo_mask = _mm_set1_epi8(15);
            const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(y, lo_mask), _mm_and_si128(_mm_srli_epi16(y, 4), lo_mask));
            const __m256i idx = _mm256_cvtepu8_epi32(x);  // lanes 8-15 (bit 3) take the second table
            return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.a, idx), _mm256_permutevar8x32_ps(t.b, idx),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
#endif
        }
        return vround<DT>(codes_f32<BITS>(b) * t.a + t.b);
    }
    vf load(int64_t l, int64_t e) const { return get(prep(l, e), l, e); }
};

// The first n positions of a cache row widened to float32 rows of d at dst; the rest of m rows
// zeroed (a block's last, partial tile).
template <class S>
static inline void widen_rows(const S& src, int64_t n, int64_t m, int64_t d, float* dst) {
    for (int64_t p = 0; p < n; p++)
        for (int64_t e = 0; e < d; e += VW) vstore(dst + p * d + e, src.load(p, e));
    for (int64_t p = n; p < m; p++)
        for (int64_t e = 0; e < d; e += VW) vstore(dst + p * d + e, vzero());
}

// The scores of ht query heads (qf + h * d, float32) against the first VW / ht positions of a
// cache row: VW accumulators, lane h * VW / ht + p of the result the dot product of head h and
// position p. Each key vector is read once for the ht heads.
template <class S, int ht>
static inline vf score_tile(const float* qf, const S& k, int64_t d) {
    constexpr int pt = VW / ht;
    vf acc[VW];
#pragma GCC unroll 16
    for (int i = 0; i < VW; i++) acc[i] = vzero();
#pragma GCC unroll 16
    for (int p = 0; p < pt; p++) {  // each key row read in order
        if constexpr (S::grouped) {  // a group's shared part prepared once
            for (int64_t e0 = 0; e0 < d; e0 += k.group) {
                const auto t = k.prep(p, e0);
                const int64_t e1 = e0 + k.group < d ? e0 + k.group : d;
                for (int64_t e = e0; e < e1; e += VW) {
                    const vf kv = k.get(t, p, e);
#pragma GCC unroll 4
                    for (int h = 0; h < ht; h++) acc[h * pt + p] = vfma(vload(qf + h * d + e), kv, acc[h * pt + p]);
                }
            }
        } else {
            for (int64_t e = 0; e < d; e += VW) {
                const vf kv = k.load(p, e);
#pragma GCC unroll 4
                for (int h = 0; h < ht; h++) acc[h * pt + p] = vfma(vload(qf + h * d + e), kv, acc[h * pt + p]);
            }
        }
    }
    return hsums(acc);
}

// The weighted sum of n positions of a cache row's values (elements [e0, e0 + ct * VW) of each)
// into gt query heads' outputs (acc + g * d), ct vectors of each: gt x ct accumulators held in
// registers over all the positions, each value vector read once for the gt heads; p: the heads'
// probabilities, ldp apart. Each output element adds its terms in position order, as one head
// at a time would. A grouped source's tile lies within one group (the caller's widths).
template <class S, int gt, int ct>
static void value_tile(const S& vs, int64_t e0, int64_t n, const float* p, int64_t ldp, float* acc, int64_t d) {
    const S v = vs;  // a local copy: its fields stay in registers
    vf a[gt][ct];
#pragma GCC unroll 8
    for (int g = 0; g < gt; g++)
#pragma GCC unroll 8
        for (int c = 0; c < ct; c++) a[g][c] = vzero();
    for (int64_t l = 0; l < n; l++) {
        vf x[ct];
        if constexpr (S::grouped) {
            const auto t = v.prep(l, e0);
#pragma GCC unroll 8
            for (int c = 0; c < ct; c++) x[c] = v.get(t, l, e0 + c * VW);
        } else {
#pragma GCC unroll 8
            for (int c = 0; c < ct; c++) x[c] = v.load(l, e0 + c * VW);
        }
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
template <class S>
using ValueTile = void (*)(const S&, int64_t, int64_t, const float*, int64_t, float*, int64_t);
template <class S, int g, int c>
struct TileTable {
    static void fill(ValueTile<S>* t) {
        t[(g - 1) * CT + c - 1] = value_tile<S, g, c>;
        if constexpr (c > 1) TileTable<S, g, c - 1>::fill(t);
        else if constexpr (g > 1) TileTable<S, g - 1, CT>::fill(t);
    }
};
template <class S>
static const ValueTile<S>* value_tiles() {
    static ValueTile<S> t[GT * CT];
    static const bool done = (TileTable<S, GT, CT>::fill(t), true);
    (void)done;
    return t;
}

// out (R, G, d) = softmax(q k^T * scale, masked) v for each row r, elements of dtype DT
// (float32, bfloat16, float16) with float32 arithmetic throughout and one rounding of the
// output: q (R, G, d) contiguous; k and v the cache's keys and values (sources S: Dense or
// Packed), positions [0, L) (a row-major chunk has ldl = d, a position-major staged disk chunk
// ldl = rows * d); mask (R, L) with row stride ldm (nonzero = visible; every row must
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
template <int DT, class S>
static void attention(const void* q, int64_t R, int64_t G, int64_t d, const S& k, const S& v, int64_t L,
                      const uint8_t* mask, int64_t ldm, const float* sinks, float scale, void* out, float* lse,
                      int nthreads) {
    const int esz = DT == DT_F32 ? 4 : 2;
    const ValueTile<S>* tiles = value_tiles<S>();
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t Lp = (L + VW - 1) / VW * VW;  // each head's scores padded with -inf
        std::vector<float> s((size_t)(G * Lp)), o((size_t)(G * d)), qf((size_t)(G * d)), tail((size_t)(VW * d));
        alignas(64) float sums[VW];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const char* qr = (const char*)q + r * G * d * esz;
            for (int64_t i = 0; i < G * d; i += VW) vstore(qf.data() + i, vload_as_f32<DT>(qr + i * esz));
            const S kr = k.row(r), vr = v.row(r);
            const uint8_t* mr = mask + r * ldm;
            const vf ninf = _set1(-INFINITY), sc = _set1(scale);
            for (int64_t g = 0; g < G; g++)  // the softmax below overwrites the padding
                for (int64_t l = L; l < Lp; l++) s[g * Lp + l] = -INFINITY;
            // tiles of S::heads heads (then 2, then 1 for the rest) share each key read
            auto score = [&](const auto& src, const float* qg, int64_t ht) -> vf {
                using T = std::decay_t<decltype(src)>;
                if constexpr (S::heads >= 4)
                    if (ht == 4) return score_tile<T, 4>(qg, src, d);
                return ht == 2 ? score_tile<T, 2>(qg, src, d) : score_tile<T, 1>(qg, src, d);
            };
            for (int64_t g = 0, ht; g < G; g += ht) {
                ht = G - g >= S::heads ? S::heads : G - g >= 2 ? 2 : 1;
                const int64_t pt = VW / ht;  // positions per tile
                const float* qg = qf.data() + g * d;
                for (int64_t l0 = 0; l0 < L; l0 += pt) {
                    const int64_t n = L - l0 < pt ? L - l0 : pt;
                    unsigned bits = 0;
                    for (int64_t i = 0; i < n; i++) bits |= (unsigned)(mr[l0 + i] != 0) << i;
                    unsigned lanes = 0;  // each head's lanes of the tile
                    for (int64_t h = 0; h < ht; h++) lanes |= bits << (h * pt);
                    vf x;
                    if (n < pt) {  // the last, partial tile: its keys widened and zero-padded
                        widen_rows(kr.at(l0), n, pt, d, tail.data());
                        x = score(Dense<DT_F32>{(const char*)tail.data(), 0, d}, qg, ht);
                    } else {
                        x = score(kr.at(l0), qg, ht);
                    }
                    x = vselect(lanes, x * sc, ninf);
                    if (ht == 1) {
                        vstore(s.data() + g * Lp + l0, x);
                    } else {
                        vstore(sums, x);
                        for (int64_t h = 0; h < ht; h++) memcpy(s.data() + (g + h) * Lp + l0, sums + h * pt, pt * 4);
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
            int64_t cw = nv < cmax ? nv : cmax;  // vectors of a tile
            int64_t gw = ACC / cw < GT ? ACC / cw : GT;  // heads of a tile
            if constexpr (S::heads_first) {  // as many heads as a tile takes, then as many vectors as fit
                gw = G < GT ? G : GT;
                cw = ACC / gw < CT ? ACC / gw : CT;
                cw = nv < cw ? nv : cw;
            }
            if constexpr (S::grouped) {  // each tile within one group: its width divides the group's
                const int64_t gv = v.group / VW;
                cw = gv < cw ? gv : cw;
                while (gv % cw) cw--;
            }
            for (int64_t g = 0; g < G; g += gw) {
                const int64_t gt = G - g < gw ? G - g : gw;
                for (int64_t c = 0; c < nv; c += cw) {
                    const int64_t ct = nv - c < cw ? nv - c : cw;
                    tiles[(gt - 1) * CT + ct - 1](vr, c * VW, L, s.data() + g * Lp, Lp, acc + g * d + c * VW, d);
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


extern "C" {

// fg_attention for a dtype code dt (0 float32, 1 bfloat16, 2 float16), over a cache in that
// dtype: position l of row r of k at k + r * ldk + l * ldl elements (v alike: ldv, ldvl); see
// attention above.
void fg_attention(const void* q, int64_t R, int64_t G, int64_t d, const void* k, int64_t ldk, int64_t ldl,
                  const void* v, int64_t ldv, int64_t ldvl, int64_t L, const uint8_t* mask, int64_t ldm,
                  const float* sinks, float scale, void* out, float* lse, int dt, int nthreads) {
    auto run = [&](auto tag) {
        constexpr int DT = decltype(tag)::value;
        const Dense<DT> ks{(const char*)k, ldk, ldl}, vs{(const char*)v, ldv, ldvl};
        attention<DT>(q, R, G, d, ks, vs, L, mask, ldm, sinks, scale, out, lse, nthreads);
    };
    if (dt == DT_BF16) run(std::integral_constant<int, DT_BF16>());
    else if (dt == DT_F16) run(std::integral_constant<int, DT_F16>());
    else run(std::integral_constant<int, DT_F32>());
}

// One packed tensor of a compressed cache (Packed above): codes' strides in bytes, the groups'
// minimums' and scales' (dtype dt) in elements, per row and per position.
struct PackedPart {
    const uint8_t* codes;
    int64_t cr, cl;
    const void* mins;
    const void* scales;
    int64_t mr, ml;
};

// fg_attention over a compressed cache: k and v as group-wise codes of ``bits`` (4 or 8) in
// groups of ``group`` elements along d (a multiple of VW), values in the dtype dt; the result
// equals fg_attention over the expanded cache bit for bit. Returns 0 where it does not apply
// (other bits, a group that splits a vector), 1 when done.
int fg_attention_packed(const void* q, int64_t R, int64_t G, int64_t d, const PackedPart* k, const PackedPart* v,
                        int64_t L, int bits, int64_t group, const uint8_t* mask, int64_t ldm, const float* sinks,
                        float scale, void* out, float* lse, int dt, int nthreads) {
    if ((bits != 4 && bits != 8) || group % VW || d % VW) return 0;
    std::vector<int32_t> gi((size_t)(d / VW));
    for (int64_t i = 0; i < d / VW; i++) gi[i] = (int32_t)(i * VW / group);
    auto run = [&](auto dtag, auto btag) {
        constexpr int DT = decltype(dtag)::value, BITS = decltype(btag)::value;
        auto src = [&](const PackedPart* x) {
            return Packed<DT, BITS>{x->codes, x->cr, x->cl, (const char*)x->mins, (const char*)x->scales, x->mr,
                                    x->ml, gi.data(), group};
        };
        attention<DT>(q, R, G, d, src(k), src(v), L, mask, ldm, sinks, scale, out, lse, nthreads);
    };
    auto with_bits = [&](auto dtag) {
        if (bits == 4) run(dtag, std::integral_constant<int, 4>());
        else run(dtag, std::integral_constant<int, 8>());
    };
    if (dt == DT_BF16) with_bits(std::integral_constant<int, DT_BF16>());
    else if (dt == DT_F16) with_bits(std::integral_constant<int, DT_F16>());
    else with_bits(std::integral_constant<int, DT_F32>());
    return 1;
}

}  // extern "C"
