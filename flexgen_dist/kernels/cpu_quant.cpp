// Group-wise min-max quantization (memory/quant.py's ``quantize``) of rows of float32, bfloat16
// or float16 values in one pass, bit for bit the reference's codes, minimums and scales: what a
// compressed KV cache stores for each new position on a CPU device (torch's path runs a dozen
// passes over small tensors per layer and step, or over the whole prompt at prefill).
//
// Per group of ``group`` elements (the last one padded with the row's last value): mn and mx in
// float32; min = mn rounded to the dtype, scale = ((mx - mn) / levels) rounded to the dtype;
// each code = round-half-even((x - min) / scale) clamped to [0, levels] (scale 0: divide by 1),
// the arithmetic in float32 on the rounded min and scale, as the reference computes it.
#include "cpu_simd.h"

#include <cmath>

template <int DT>
static void quant_rows(const char* x, int64_t rows, int64_t n, int64_t ldx, int64_t group, int bits, uint8_t* codes,
                       int64_t ldc, char* mins, char* scales, int64_t ldm, int nthreads) {
    const int esz = DT == DT_F32 ? 4 : 2;
    const int64_t groups = (n + group - 1) / group, width = groups * group;
    const int64_t packed = (width * bits + 7) / 8;
    const float levels = (float)((1 << bits) - 1);
#pragma omp parallel num_threads(nthreads) if (rows * n >= 65536)
    {
        std::vector<float> f((size_t)width);
        std::vector<uint8_t> q((size_t)width + 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const char* xr = x + r * ldx * esz;
            int64_t e = 0;
            for (; e + VW <= n; e += VW) vstore(f.data() + e, vload_as_f32<DT>(xr + e * esz));
            for (; e < n; e++) f[e] = ld1<DT>((const Elem<DT>*)xr, e);
            for (; e < width; e++) f[e] = f[n - 1];  // the padding repeats the last value
            for (int64_t g = 0; g < groups; g++) {
                const float* fg = f.data() + g * group;
                float mn = fg[0], mx = fg[0];
                int64_t i = 0;
                if (group >= VW) {
                    vf vmn = vload(fg), vmx = vmn;
                    for (i = VW; i + VW <= group; i += VW) {
                        vmn = vmin(vmn, vload(fg + i));
                        vmx = vmax(vmx, vload(fg + i));
                    }
                    mx = hmax(vmx);
                    mn = hmin(vmn);
                }
                for (; i < group; i++) {
                    mn = fg[i] < mn ? fg[i] : mn;
                    mx = fg[i] > mx ? fg[i] : mx;
                }
                const float ms = rnd1<DT>(mn), ss = rnd1<DT>((mx - mn) / levels);
                ((Elem<DT>*)mins)[r * ldm + g] = to_dt<DT>(ms);
                ((Elem<DT>*)scales)[r * ldm + g] = to_dt<DT>(ss);
                const float safe = ss > 0.f ? ss : 1.f;
                uint8_t* qg = q.data() + g * group;
                for (int64_t j = 0; j < group; j++) {
                    float c = std::nearbyint((fg[j] - ms) / safe);
                    c = c < 0.f ? 0.f : c > levels ? levels : c;
                    qg[j] = (uint8_t)c;
                }
            }
            uint8_t* cr = codes + r * ldc;
            if (bits == 8) {
                memcpy(cr, q.data(), (size_t)width);
            } else {
                q[width] = 0;  // an odd width's last byte holds one code
                for (int64_t b = 0; b < packed; b++) cr[b] = (uint8_t)(q[2 * b] | q[2 * b + 1] << 4);
            }
        }
    }
}

extern "C" {

// Rows of x (rows, n; row stride ldx elements, dtype dt) quantized in groups of ``group`` to
// ``bits`` (4 or 8): codes (rows, packed; row stride ldc bytes), mins and scales (rows, groups;
// row stride ldm elements) in the dtype. Returns 0 for other bits (nothing written).
int fg_quant(const void* x, int64_t rows, int64_t n, int64_t ldx, int dt, int64_t group, int bits, uint8_t* codes,
             int64_t ldc, void* mins, void* scales, int64_t ldm, int nthreads) {
    if (bits != 4 && bits != 8) return 0;
    auto* mn = (char*)mins;
    auto* sc = (char*)scales;
    if (dt == DT_BF16) quant_rows<DT_BF16>((const char*)x, rows, n, ldx, group, bits, codes, ldc, mn, sc, ldm, nthreads);
    else if (dt == DT_F16) quant_rows<DT_F16>((const char*)x, rows, n, ldx, group, bits, codes, ldc, mn, sc, ldm, nthreads);
    else quant_rows<DT_F32>((const char*)x, rows, n, ldx, group, bits, codes, ldc, mn, sc, ldm, nthreads);
    return 1;
}

}  // extern "C"
