// XLA:CPU FFI handlers of gguf_a8: GGUF-style grouped weights (4-bit groups as
// jaxserve_qmm_q4g stores them, or Q8_0-like int8 groups as jaxserve_qmm_q8g) x
// activations quantized to int8 in blocks of the weight's group of 32 inputs
// (quant_format.quantize_act_blocks: sx = amax * kActScale per (block, column), xq =
// clip(rint(x * (1 / sx)), -127, 127), all in f32) -> f32 [F, M]:
//
//   out[f, m] = sum_g s[f, g] sx[g, m] sum_{d in g} q[f, d] xq[d, m]
//             + z[f, g] sx[g, m] sum_{d in g} xq[d, m]          (q4g; Q8_0: no zero term)
//
// = W_dequantized @ (sx xq) up to f32 rounding; the inner sums are exact int32.
//
// Targets (registered by ffi.py, platform "cpu"; attributes isa and threads as kernel.cc's):
//   jaxserve_qmm_q4g_a8 (q u8[(L,) F, D/2], scale f16[(L,) F, G], zero f16[(L,) F, G],
//                        x f32[D, M], layer s32[])
//   jaxserve_qmm_q8g_a8 (q s8[(L,) F, D], scale f16[(L,) F, G], x f32[D, M], layer s32[])
// with D / G == 32 (the activation block is the weight's group).
//
// With AVX-512 VNNI and F % 16 == 0: the 16 int32 lanes of a zmm hold 16 output rows. A
// panel of 32 weight rows x all of D is repacked per thread into "VNNI order" (for each
// group and quad k of 4 inputs, one 64-byte vector = 16 rows x 4 bytes) with its scales
// (and zeros) in f32; then per 4-column tile and group, 8 vpdpbusd per row vector
// (weights x a broadcast of the column's 4 activation bytes) and an epilogue
// facc += cvt(iacc) (s sx) [+ z (sx sum xq)]. 4-bit values 0..15 are vpdpbusd's unsigned
// operand and xq its signed one; Q8_0's signed weights take xq + 128 as the unsigned
// operand, and each group's accumulator starts at -128 sum q (once per panel), so no
// correction op runs per product.
//
// Measured on the 2-core AMD EPYC (Zen 4, AVX-512 VNNI, no AMX; one thread, median of 7,
// prototype of this code): at M = 32, 262-270 GOP/s-equivalent (2 F D M / t) for 4-bit
// groups and 248-291 for Q8_0 at SmolLM2's 576 x 576 ... 1536 x 576 shapes, against 116
// GFLOP/s of a register-blocked f32 FMA GEMM (2.3-2.6x; the LM head's 49152 x 576 Q8_0:
// 168 against 97); zmm FMA peak 117 GFLOP/s, vpdpbusd 470 GOP/s per core. Zen 4 issues
// one of vpdpbusd / vfmadd / vmulps per cycle, so each group's epilogue takes slots from
// the dot products: that caps 4-bit groups at ~73% of the vpdpbusd peak.
//
// Below 12 columns, without AVX-512 VNNI or with a ragged F: x is replaced by its int8
// blocks' values (sx xq, the same f32 values as quant_format.fake_quantize_act_blocks)
// and kernel.cc's weight-only grouped matmul runs on them (the definition, up to f32
// rounding).

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernel_common.h"

namespace jaxserve_qmm {

// quant_format.ACT_SCALE: a block's scale is its amax times 1/127 rounded to f32.
constexpr float kActScale = float(1.0 / 127.0);

// Block-quantized activations (prepare_act): xq / xu [M][D] (a column's D bytes
// contiguous; xu = xq + 128), sx and zs [G][Ms] (Ms = M rounded up to 16) with
// zs = sx * sum_{d in g} xq.
struct ActQ {
  int D = 0, M = 0, G = 0, Ms = 0;
  std::vector<int8_t> xq;
  std::vector<uint8_t> xu;
  std::vector<float> sx, zs;
  ActQ(int D_, int M_) : D(D_), M(M_), G(D_ / 32), Ms((M_ + 15) & ~15) {
    xq.resize(size_t(M) * D);
    xu.resize(size_t(M) * D);
    sx.resize(size_t(G) * Ms);
    zs.resize(size_t(G) * Ms);
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace a8 {
namespace {

// Per 128-bit lane, transpose the 4x4 dword matrix formed by (a, b, c, d).
inline void inlane4x4(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  __m512i t0 = _mm512_unpacklo_epi32(a, b), t1 = _mm512_unpackhi_epi32(a, b);
  __m512i t2 = _mm512_unpacklo_epi32(c, d), t3 = _mm512_unpackhi_epi32(c, d);
  a = _mm512_unpacklo_epi64(t0, t2);
  b = _mm512_unpackhi_epi64(t0, t2);
  c = _mm512_unpacklo_epi64(t1, t3);
  d = _mm512_unpackhi_epi64(t1, t3);
}
// Transpose the 4x4 matrix of 128-bit lanes formed by (a, b, c, d).
inline void lane4x4(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  __m512i w0 = _mm512_shuffle_i32x4(a, b, 0x44), w1 = _mm512_shuffle_i32x4(a, b, 0xEE);
  __m512i w2 = _mm512_shuffle_i32x4(c, d, 0x44), w3 = _mm512_shuffle_i32x4(c, d, 0xEE);
  a = _mm512_shuffle_i32x4(w0, w2, 0x88);
  b = _mm512_shuffle_i32x4(w0, w2, 0xDD);
  c = _mm512_shuffle_i32x4(w1, w3, 0x88);
  d = _mm512_shuffle_i32x4(w1, w3, 0xDD);
}
// 4x16 -> 16x4: in: v_k dword i = A[k][i]; out: v_j lane L = (A[0][i],A[1][i],A[2][i],A[3][i]),
// i=4j+L
inline void tr4x16(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  inlane4x4(a, b, c, d);
  lane4x4(a, b, c, d);
}
// 16x4 -> 4x16 (inverse of tr4x16; both stages are involutions).
inline void tr16x4(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  lane4x4(a, b, c, d);
  inlane4x4(a, b, c, d);
}

// 16x16 dword transpose in place (r[i] lane j <-> r[j] lane i).
inline void tr16x16(__m512i r[16]) {
  for (int i = 0; i < 4; ++i) inlane4x4(r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
  for (int e = 0; e < 4; ++e) lane4x4(r[e], r[4 + e], r[8 + e], r[12 + e]);
}

// Store the four 128-bit lanes of v to p, p+ld, p+2ld, p+3ld (ld in bytes).
inline void store_lanes(__m512i v, void* p, size_t ld) {
  char* c = (char*)p;
  _mm_storeu_si128((__m128i*)c, _mm512_castsi512_si128(v));
  _mm_storeu_si128((__m128i*)(c + ld), _mm512_extracti32x4_epi32(v, 1));
  _mm_storeu_si128((__m128i*)(c + 2 * ld), _mm512_extracti32x4_epi32(v, 2));
  _mm_storeu_si128((__m128i*)(c + 3 * ld), _mm512_extracti32x4_epi32(v, 3));
}
// Load 4 rows of 16 bytes (p, p+ld, p+2ld, p+3ld) into the 4 lanes of a zmm.
inline __m512i load_lanes(const void* p, size_t ld) {
  const char* c = (const char*)p;
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)c));
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(c + ld)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(c + 2 * ld)), 2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(c + 3 * ld)), 3);
  return v;
}

// Thread-local scratch for the on-the-fly panel repack.
struct Scratch {
  void* p = nullptr;
  size_t cap = 0;
  void* get(size_t n) {
    if (n > cap) {
      std::free(p);
      cap = (n + 4095) & ~(size_t)4095;
      p = std::aligned_alloc(64, cap);
    }
    return p;
  }
  ~Scratch() { std::free(p); }
};
thread_local Scratch tl_scratch;

struct PanelBufs {  // views into one panel's repacked data
  uint8_t* w;
  float* s;
  float* z;  // z: q4 zeros (f32) or q8 iacc init (int32 bits)
};
inline size_t panel_w_bytes(int G, int R) { return (size_t)G * 8 * R * 64; }
inline size_t panel_f_floats(int G, int R) { return (size_t)G * R * 16; }
PanelBufs scratch_panel(int G, int R) {
  size_t wb = panel_w_bytes(G, R), fb = panel_f_floats(G, R) * 4;
  char* base = (char*)tl_scratch.get(wb + 2 * fb);
  return {(uint8_t*)base, (float*)(base + wb), (float*)(base + wb + fb)};
}

// f16 [F, G] (rows fb .. fb+16R) -> f32 [G][R][16] via 16x16 transposes.
template <int R>
void pack_scales(const uint16_t* s, int G, int fb, float* dst) {
  for (int rv = 0; rv < R; ++rv) {
    const uint16_t* src = s + (size_t)(fb + 16 * rv) * G;
    for (int g0 = 0; g0 < G; g0 += 16) {
      const int n = std::min(16, G - g0);
      const __mmask16 mk = (__mmask16)((1u << n) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_castps_si512(
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, src + (size_t)i * G + g0)));
      tr16x16(r);  // r[j] = group g0+j, lanes = 16 rows
      for (int j = 0; j < n; ++j) _mm512_store_si512(dst + ((size_t)(g0 + j) * R + rv) * 16, r[j]);
    }
  }
}

// q4g weights of rows [fb, fb+16R) -> VNNI-ordered u8 (values 0..15), [G][8][R][64].
template <int R>
void pack_q4_weights(const uint8_t* q, int D, int fb, uint8_t* dst) {
  const int G = D / 32;
  const size_t ld = (size_t)D / 2;
  // Within each dword (= packed bytes b0 b1 b2 b3 = inputs 8j..8j+7 of one row):
  // quad 2j   = (b0.lo, b0.hi, b1.lo, b1.hi), quad 2j+1 = (b2.lo, b2.hi, b3.lo, b3.hi).
  const __m512i idxA =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13));
  const __m512i idxB =
      _mm512_broadcast_i32x4(_mm_setr_epi8(2, 2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14, 15, 15));
  const __m512i m0f = _mm512_set1_epi8(0x0F);
  const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
  for (int rv = 0; rv < R; ++rv) {
    const uint8_t* src = q + (size_t)(fb + 16 * rv) * ld;
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = src + 16 * g;  // 16 packed bytes = 32 inputs of group g
      __m512i v0 = load_lanes(p, ld), v1 = load_lanes(p + 4 * ld, ld);
      __m512i v2 = load_lanes(p + 8 * ld, ld), v3 = load_lanes(p + 12 * ld, ld);
      tr16x4(v0, v1, v2, v3);  // v_j dword r = packed bytes 4j..4j+3 of row r
      __m512i v[4] = {v0, v1, v2, v3};
      for (int j = 0; j < 4; ++j) {
        __m512i lo = _mm512_and_si512(v[j], m0f);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v[j], 4), m0f);
        __m512i qa = _mm512_mask_shuffle_epi8(_mm512_shuffle_epi8(lo, idxA), odd, hi, idxA);
        __m512i qb = _mm512_mask_shuffle_epi8(_mm512_shuffle_epi8(lo, idxB), odd, hi, idxB);
        _mm512_store_si512(dst + (((size_t)g * 8 + 2 * j) * R + rv) * 64, qa);
        _mm512_store_si512(dst + (((size_t)g * 8 + 2 * j + 1) * R + rv) * 64, qb);
      }
    }
  }
}

// q8g weights of rows [fb, fb+16R) -> VNNI-ordered s8 [G][8][R][64] and iacc init
// int32 [G][R][16] = -128 * sum_{d in g} q[f, d].
template <int R>
void pack_q8_weights(const int8_t* q, int D, int fb, uint8_t* dst, int32_t* init) {
  const int G = D / 32;
  const size_t ld = (size_t)D;
  const __m512i ones = _mm512_set1_epi8(1);
  for (int rv = 0; rv < R; ++rv) {
    const int8_t* src = q + (size_t)(fb + 16 * rv) * ld;
    for (int g = 0; g < G; ++g) {
      __m512i rowsum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {  // quads 4h..4h+3
        const int8_t* p = src + 32 * g + 16 * h;
        __m512i v[4] = {load_lanes(p, ld), load_lanes(p + 4 * ld, ld), load_lanes(p + 8 * ld, ld),
                        load_lanes(p + 12 * ld, ld)};
        tr16x4(v[0], v[1], v[2], v[3]);
        for (int j = 0; j < 4; ++j) {
          _mm512_store_si512(dst + (((size_t)g * 8 + 4 * h + j) * R + rv) * 64, v[j]);
          rowsum = _mm512_dpbusd_epi32(rowsum, ones, v[j]);  // += sum of 4 s8 per row
        }
      }
      _mm512_store_si512(init + ((size_t)g * R + rv) * 16,
                         _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(rowsum, 7)));
    }
  }
}

template <int R>
void pack_q4_panel(const uint8_t* q, const uint16_t* s, const uint16_t* z, int D, int fb,
                   PanelBufs pb) {
  pack_q4_weights<R>(q, D, fb, pb.w);
  pack_scales<R>(s, D / 32, fb, pb.s);
  pack_scales<R>(z, D / 32, fb, pb.z);
}
template <int R>
void pack_q8_panel(const int8_t* q, const uint16_t* s, int D, int fb, PanelBufs pb) {
  pack_q8_weights<R>(q, D, fb, pb.w, (int32_t*)pb.z);
  pack_scales<R>(s, D / 32, fb, pb.s);
}

// Store facc[R][C] (lanes = 16 rows) of the tile at rows outp[0 .. 16R), columns m0 .. m0+C.
template <int R, int C>
inline void store_tile(const __m512 (&facc)[R][C], float* outp, int M, int m0) {
  if constexpr (C % 4 == 0) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c4 = 0; c4 < C; c4 += 4) {
        __m512i v0 = _mm512_castps_si512(facc[r][c4]), v1 = _mm512_castps_si512(facc[r][c4 + 1]);
        __m512i v2 = _mm512_castps_si512(facc[r][c4 + 2]),
                v3 = _mm512_castps_si512(facc[r][c4 + 3]);
        tr4x16(v0, v1, v2, v3);  // v_j lane L = row 4j+L, columns c4..c4+3
        float* p = outp + (size_t)(16 * r) * M + m0 + c4;
        const size_t ld = (size_t)M * 4 * sizeof(float);  // 4 rows
        store_lanes(v0, p, M * sizeof(float));
        store_lanes(v1, (char*)p + ld, M * sizeof(float));
        store_lanes(v2, (char*)p + 2 * ld, M * sizeof(float));
        store_lanes(v3, (char*)p + 3 * ld, M * sizeof(float));
      }
  } else {  // narrow / tail tiles: scalar scatter
    alignas(64) float tmp[16];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        _mm512_store_ps(tmp, facc[r][c]);
        for (int i = 0; i < 16; ++i) outp[(size_t)(16 * r + i) * M + m0 + c] = tmp[i];
      }
  }
}

// One R x C tile: rows = panel (16R rows), columns m0 .. m0+C. Q8=false: q4g (u8 weights x s8
// activations, zero term); Q8=true: q8g (u8 activations xq+128 x s8 weights, iacc init).
template <bool Q8, int R, int C>
inline void tile_kernel(const uint8_t* pw, const float* ps, const float* pz, const ActQ& a, int m0,
                        float* outp) {
  const int D = a.D, M = a.M, G = a.G;
  // Activation bytes: q4 -> signed xq, q8 -> unsigned xu. Row m contiguous over d.
  const uint8_t* xp =
      Q8 ? a.xu.data() + (size_t)m0 * D : (const uint8_t*)a.xq.data() + (size_t)m0 * D;
  const float* sxp = a.sx.data() + m0;
  const float* zsp = a.zs.data() + m0;

  __m512 facc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) facc[r][c] = _mm512_setzero_ps();

  for (int g = 0; g < G; ++g) {
    __m512i iacc[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m512i init = Q8 ? _mm512_load_si512(pz + ((size_t)g * R + r) * 16) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) iacc[r][c] = init;
    }
    const uint8_t* wg = pw + (size_t)g * 8 * R * 64;
    const uint8_t* xg = xp + 32 * g;
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      __m512i w[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) w[r] = _mm512_load_si512(wg + (k * R + r) * 64);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        int32_t x4;
        std::memcpy(&x4, xg + (size_t)c * D + 4 * k, 4);
        const __m512i xb = _mm512_set1_epi32(x4);  // q4: folds into {1to16} operand
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          iacc[r][c] = Q8 ? _mm512_dpbusd_epi32(iacc[r][c], xb, w[r])
                          : _mm512_dpbusd_epi32(iacc[r][c], w[r], xb);
      }
    }
    // Group epilogue: facc += cvt(iacc) * (s * sx[g,m])  [+ z * zs[g,m]]
    __m512 sv[R], zv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      sv[r] = _mm512_load_ps(ps + ((size_t)g * R + r) * 16);
      if (!Q8) zv[r] = _mm512_load_ps(pz + ((size_t)g * R + r) * 16);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 sxv = _mm512_set1_ps(sxp[(size_t)g * a.Ms + c]);
      const __m512 zsv = _mm512_set1_ps(zsp[(size_t)g * a.Ms + c]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        facc[r][c] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][c]), _mm512_mul_ps(sv[r], sxv), facc[r][c]);
        if (!Q8) facc[r][c] = _mm512_fmadd_ps(zv[r], zsv, facc[r][c]);
      }
    }
  }
  store_tile<R, C>(facc, outp, M, m0);
}

// Columns [m, mend) of one panel: full C-wide tiles, then the ragged tail with C/2, C/4, ...
template <bool Q8, int R, int C>
void panel_cols(const uint8_t* pw, const float* ps, const float* pz, const ActQ& a, int m, int mend,
                float* outp) {
  for (; m + C <= mend; m += C) tile_kernel<Q8, R, C>(pw, ps, pz, a, m, outp);
  if constexpr (C > 1)
    if (m < mend) panel_cols<Q8, R, C / 2>(pw, ps, pz, a, m, mend, outp);
}

// Rows [f0, f1) with on-the-fly repack: panels of 16R rows, then a 16-row (R=1) tail.
template <bool Q8, int R, int C>
void rows_onthefly(const void* q, const uint16_t* s, const uint16_t* z, const ActQ& a, int f0,
                   int f1, float* out, int m0, int m1) {
  const int D = a.D, G = a.G;
  PanelBufs pb = scratch_panel(G, R);
  int f = f0;
  for (; f + 16 * R <= f1; f += 16 * R) {
    if constexpr (Q8)
      pack_q8_panel<R>((const int8_t*)q, s, D, f, pb);
    else
      pack_q4_panel<R>((const uint8_t*)q, s, z, D, f, pb);
    panel_cols<Q8, R, C>(pb.w, pb.s, pb.z, a, m0, m1, out + (size_t)f * a.M);
  }
  if constexpr (R > 1)
    if (f < f1) rows_onthefly<Q8, 1, C>(q, s, z, a, f, f1, out, m0, m1);
  // Ragged F ((f1 - f0) % 16 != 0) is not handled here; see README.
}

// Rows [f0, f1) (multiples of 16): panels of 16R rows repacked per thread, then a 16-row
// (R = 1) tail.
template <bool Q8, int R, int C>
void rows_onthefly(const void* q, const uint16_t* s, const uint16_t* z, const ActQ& a, int f0,
                   int f1, float* out) {
  const int D = a.D, G = a.G;
  PanelBufs pb = scratch_panel(G, R);
  int f = f0;
  for (; f + 16 * R <= f1; f += 16 * R) {
    if constexpr (Q8)
      pack_q8_panel<R>((const int8_t*)q, s, D, f, pb);
    else
      pack_q4_panel<R>((const uint8_t*)q, s, z, D, f, pb);
    panel_cols<Q8, R, C>(pb.w, pb.s, pb.z, a, 0, a.M, out + (size_t)f * a.M);
  }
  if constexpr (R > 1)
    if (f < f1) rows_onthefly<Q8, 1, C>(q, s, z, a, f, f1, out);
}

}  // namespace

// Activation quantization. Vector lanes = 16 columns m; per group the 32 inputs are quantized,
// packed 4-per-dword (quad k) and transposed (tr4x16) so each column's 32 bytes are contiguous.
void prepare_act(const float* x, ActQ& a) {
  const int D = a.D, M = a.M, g0 = 0, g1 = a.G, mb = 0, me = M;
  const __m512 kScale = _mm512_set1_ps(kActScale), one = _mm512_set1_ps(1.f);
  const __m512i lim_hi = _mm512_set1_epi32(127), lim_lo = _mm512_set1_epi32(-127);
  const __m512i mff = _mm512_set1_epi32(0xFF), x80 = _mm512_set1_epi8((char)0x80);
  for (int g = g0; g < g1; ++g) {
    for (int m0 = mb; m0 < me; m0 += 16) {
      const int n = std::min(16, me - m0);
      const __mmask16 mk = (__mmask16)((1u << n) - 1);
      const float* xg = x + (size_t)32 * g * M + m0;
      // Pass 1: amax over the 32 inputs of the group, per column.
      __m512 amax = _mm512_setzero_ps();
      for (int i = 0; i < 32; ++i)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, xg + (size_t)i * M)));
      __m512 sx = _mm512_mul_ps(amax, kScale);
      sx = _mm512_mask_mov_ps(sx, _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_EQ_OQ), one);
      const __m512 inv = _mm512_div_ps(one, sx);
      // Pass 2: xq = clip(rne(x * (1 / sx))), packed 4 inputs per dword.
      __m512i isum = _mm512_setzero_si512();
      __m512i p[8];
      for (int k = 0; k < 8; ++k) {
        __m512i qv[4];
        for (int i = 0; i < 4; ++i) {
          __m512 xv = _mm512_maskz_loadu_ps(mk, xg + (size_t)(4 * k + i) * M);
          __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(xv, inv));  // MXCSR: nearest-even
          qi = _mm512_min_epi32(_mm512_max_epi32(qi, lim_lo), lim_hi);
          isum = _mm512_add_epi32(isum, qi);
          qv[i] = qi;
        }
        p[k] = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(qv[0], mff),
                                               _mm512_slli_epi32(_mm512_and_si512(qv[1], mff), 8)),
                               _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(qv[2], mff), 16),
                                               _mm512_slli_epi32(qv[3], 24)));
      }
      _mm512_mask_storeu_ps(a.sx.data() + (size_t)g * a.Ms + m0, mk, sx);
      _mm512_mask_storeu_ps(a.zs.data() + (size_t)g * a.Ms + m0, mk,
                            _mm512_mul_ps(sx, _mm512_cvtepi32_ps(isum)));
      tr4x16(p[0], p[1], p[2], p[3]);  // p[j] lane L: column m0+4j+L, bytes 0..15 of group
      tr4x16(p[4], p[5], p[6], p[7]);  //                              bytes 16..31
      int8_t* dq = a.xq.data() + (size_t)m0 * D + 32 * g;
      uint8_t* du = a.xu.data() + (size_t)m0 * D + 32 * g;
      for (int j = 0; j < 4; ++j) {
        const int nl = std::min(4, n - 4 * j);  // valid lanes (columns) in p[j]
        if (nl <= 0) break;
        const size_t off = (size_t)4 * j * D;
        if (nl == 4) {
          store_lanes(p[j], dq + off, D);
          store_lanes(p[4 + j], dq + off + 16, D);
          store_lanes(_mm512_xor_si512(p[j], x80), du + off, D);
          store_lanes(_mm512_xor_si512(p[4 + j], x80), du + off + 16, D);
        } else {  // ragged column tail
          alignas(64) uint8_t t0[64], t1[64];
          _mm512_store_si512(t0, p[j]);
          _mm512_store_si512(t1, p[4 + j]);
          for (int L = 0; L < nl; ++L)
            for (int b = 0; b < 16; ++b) {
              dq[off + (size_t)L * D + b] = (int8_t)t0[16 * L + b];
              dq[off + (size_t)L * D + 16 + b] = (int8_t)t1[16 * L + b];
              du[off + (size_t)L * D + b] = t0[16 * L + b] ^ 0x80;
              du[off + (size_t)L * D + 16 + b] = t1[16 * L + b] ^ 0x80;
            }
        }
      }
    }
  }
}

// rows [f0, f1) of out with the 2 x 4 blocking (2 row vectors x 4 columns: 8 int32 and 8
// f32 accumulators; 1 x 8 measured alike, 2 x 2 and R >= 3 10-35% slower).
void q4g_rows(const uint8_t* q, const uint16_t* s, const uint16_t* z, const ActQ& a, int64_t f0,
              int64_t f1, float* out) {
  rows_onthefly<false, 2, 4>(q, s, z, a, int(f0), int(f1), out);
}
void q8g_rows(const int8_t* q, const uint16_t* s, const ActQ& a, int64_t f0, int64_t f1,
              float* out) {
  rows_onthefly<true, 2, 4>(q, s, nullptr, a, int(f0), int(f1), out);
}

}  // namespace a8
#pragma GCC pop_options

std::vector<float> fake_quantize_act_blocks(const float* x, int64_t D, int64_t M) {
  std::vector<float> xf(size_t(D) * M);
  for (int64_t g = 0; g < D / 32; ++g)
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      for (int64_t d = 32 * g; d < 32 * g + 32; ++d) amax = std::max(amax, std::fabs(x[d * M + m]));
      const float sx = amax > 0.f ? amax * kActScale : 1.f, inv = 1.f / sx;
      for (int64_t d = 32 * g; d < 32 * g + 32; ++d) {
        const float q = std::min(127.f, std::max(-127.f, std::nearbyint(x[d * M + m] * inv)));
        xf[d * M + m] = q * sx;
      }
    }
  return xf;
}

namespace {

// The VNNI panels from this many columns (below: the activations' int8 block values
// through kernel.cc's weight-only row tiles, which read the weights once per call
// instead of repacking them); quant_matmul_cpu.A8_PANEL_COLUMNS repeats it.
constexpr int64_t kA8Panel = 12;

// Threads split rows in whole 48-row chunks (parallel_rows), multiples of 16.
bool vnni_path(int32_t isa, int64_t F, int64_t M) {
  return pick_isa(isa) == 2 && F % 16 == 0 && M >= kA8Panel;
}

}  // namespace

ffi::Error Q4gA8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> scale,
                     ffi::Buffer<ffi::F16> zero, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int32_t isa,
                     int32_t threads) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions()), zp_ = part(zero.dimensions());
  const int64_t D = x.dimensions().front();
  if (x.dimensions().size() != 2 || !qp_.L || sp_.L != qp_.L || zp_.L != qp_.L ||
      sp_.dims != zp_.dims || sp_.dims[0] != qp_.dims[0] || D != 2 * qp_.dims[1] ||
      D != 32 * sp_.dims[1])
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q4g_a8: q [(L,) F, D/2], scale and zero [(L,) F, D/32], x [D, M]");
  const int64_t F = qp_.dims[0], G = sp_.dims[1], M = x.dimensions().back();
  JS_LAYER("jaxserve_qmm_q4g_a8", qp_.L)
  const uint8_t* qp = q.typed_data() + li * F * (D / 2);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G;
  const uint16_t* z = reinterpret_cast<const uint16_t*>(zero.typed_data()) + li * F * G;
  float* o = out->typed_data();
  if (!vnni_path(isa, F, M)) {
    const std::vector<float> xf = fake_quantize_act_blocks(x.typed_data(), D, M);
    q4g_matmul_x(pool, threads, pick_isa(isa), qp, s, z, xf.data(), F, D, G, M, o);
    return ffi::Error::Success();
  }
  ActQ a{int(D), int(M)};
  a8::prepare_act(x.typed_data(), a);
  parallel_rows(pool, threads, F, F * D * M / 4,
                [&](int64_t f0, int64_t f1) { a8::q4g_rows(qp, s, z, a, f0, f1, o); });
  return ffi::Error::Success();
}

ffi::Error Q8gA8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F16> scale,
                     ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                     ffi::ResultBuffer<ffi::F32> out, int32_t isa, int32_t threads) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions());
  const int64_t D = x.dimensions().front();
  if (x.dimensions().size() != 2 || !qp_.L || sp_.L != qp_.L || sp_.dims[0] != qp_.dims[0] ||
      D != qp_.dims[1] || D != 32 * sp_.dims[1])
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q8g_a8: q [(L,) F, D], scale [(L,) F, D/32], x [D, M]");
  const int64_t F = qp_.dims[0], G = sp_.dims[1], M = x.dimensions().back();
  JS_LAYER("jaxserve_qmm_q8g_a8", qp_.L)
  const int8_t* qp = q.typed_data() + li * F * D;
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G;
  float* o = out->typed_data();
  if (!vnni_path(isa, F, M)) {
    const std::vector<float> xf = fake_quantize_act_blocks(x.typed_data(), D, M);
    q8g_matmul_x(pool, threads, pick_isa(isa), qp, s, xf.data(), F, D, G, M, o);
    return ffi::Error::Success();
  }
  ActQ a{int(D), int(M)};
  a8::prepare_act(x.typed_data(), a);
  parallel_rows(pool, threads, F, F * D * M / 4,
                [&](int64_t f0, int64_t f1) { a8::q8g_rows(qp, s, a, f0, f1, o); });
  return ffi::Error::Success();
}

}  // namespace jaxserve_qmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ4gA8, jaxserve_qmm::Q4gA8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ8gA8, jaxserve_qmm::Q8gA8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("threads"));
