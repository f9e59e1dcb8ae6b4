// XLA:CPU FFI handlers: quantized weight [F, D] x f32 activations [D, M] -> f32 [F, M],
// reading the weights as quant.py stores them (see this folder's __init__.py for the
// design and the measured tables).
//
// Targets (registered by ffi.py, all platform "cpu"; attributes isa: -1 the best this
// CPU runs, 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512 F/BW/VL/VNNI; threads: 0 XLA's
// intra-op pool size, n at most n threads; the weight-only ones also panel: -1 the
// panel path (kernel_panel.inc) from kPanel* columns on, 0 the row tiles, 1 panels):
//   jaxserve_qmm_int8  (q s8[F, D], scale f32[F, 1], x f32[D, M])
//   jaxserve_qmm_q8g   (q s8[F, D], scale f16[F, G], x f32[D, M])         gs = D / G
//   jaxserve_qmm_q4g   (q u8[F, D/2], scale f16[F, G], zero f16[F, G], x f32[D, M])
//   jaxserve_qmm_w8a8  (q s8[F, D], scale f32[F, 1], xq s8[D, M], sx f32[1, M])
//   jaxserve_qmm_f32   (w f32[F, D], x f32[D, M])
// Every target takes one more operand last, layer s32[]: the weight parts may also be
// stacked over a scanned run of layers ([L, F, D], scales [L, F, G]), and the handler
// reads layer `layer`'s part in place (a scan's slice would be a copy of the layer's
// weights on XLA:CPU); for 2-D parts it must be 0.
//
// The vector bodies live in kernel_body.inc, compiled three times under
// `#pragma GCC target` regions (the region form of __attribute__((target)): it
// reaches the templates and lambdas too); the level runs by __builtin_cpu_supports.
// Built with -O3 -std=c++17 -fPIC, never -march=native.

#include <immintrin.h>

#include <cstring>

#include "kernel_common.h"

namespace jaxserve_qmm {

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 1024));
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 1023) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace scalar {
struct V {
  using F = float;
  using A = int8_t;
  static constexpr int W = 1;
  static constexpr int kCols = 4;
  static constexpr bool kLut4 = false;
  static F zero() { return 0.f; }
  static F set1(float v) { return v; }
  static F load(const float* p) { return *p; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static float reduce(F a) { return a; }
  static F cvt_i8(const int8_t* p) { return float(*p); }
  static void unpack4(const uint8_t* p, F& lo, F& hi) { lo = float(*p & 15); hi = float(*p >> 4); }
  static float h2f(uint16_t h) { return half_to_float(h); }
  static void prepare_act(const int8_t* xq, int64_t D, int64_t M, A* xqt) {
    for (int64_t d = 0; d < D; ++d)
      for (int64_t m = 0; m < M; ++m) xqt[m * D + d] = xq[d * M + m];
  }
  template <int C>
  static void dot_i8(const int8_t* q, const A* xqt, int64_t D, int32_t* acc) {
    for (int c = 0; c < C; ++c) {
      int32_t s = 0;
      for (int64_t d = 0; d < D; ++d) s += int32_t(q[d]) * int32_t(xqt[c * D + d]);
      acc[c] = s;
    }
  }
};
#include "kernel_body.inc"
#include "kernel_panel.inc"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
struct V {
  using F = __m256;
  using A = int8_t;
  static constexpr int W = 8;
  static constexpr int kCols = 4;  // 2 rows x 4 columns of 16 ymm
  static constexpr bool kLut4 = false;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F cvt_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static void unpack4(const uint8_t* p, F& lo, F& hi) {
    __m128i b = _mm_loadl_epi64((const __m128i*)p), m = _mm_set1_epi8(15);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, m)));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
  }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static void prepare_act(const int8_t* xq, int64_t D, int64_t M, A* xqt) {
    for (int64_t d = 0; d < D; ++d)
      for (int64_t m = 0; m < M; ++m) xqt[m * D + d] = xq[d * M + m];
  }
  template <int C>
  static void dot_i8(const int8_t* q, const A* xqt, int64_t D, int32_t* acc) {
    __m256i a[C];
    for (int c = 0; c < C; ++c) a[c] = _mm256_setzero_si256();
    const int64_t Dv = D / 16 * 16;
    for (int64_t d = 0; d < Dv; d += 16) {
      __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + d)));
      for (int c = 0; c < C; ++c) {
        __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(xqt + c * D + d)));
        a[c] = _mm256_add_epi32(a[c], _mm256_madd_epi16(w, x));
      }
    }
    for (int c = 0; c < C; ++c) {
      int32_t s = hsum_i32(a[c]);
      for (int64_t d = Dv; d < D; ++d) s += int32_t(q[d]) * int32_t(xqt[c * D + d]);
      acc[c] = s;
    }
  }
};
#include "kernel_body.inc"
#include "kernel_panel.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512 {
struct V {
  using F = __m512;
  using A = uint8_t;  // xq + 128: vpdpbusd multiplies unsigned by signed bytes
  static constexpr int W = 16;
  static constexpr int kCols = 8;  // 2 rows x 8 columns of 32 zmm
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(F a) { return _mm512_reduce_add_ps(a); }
  static F cvt_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static void unpack4(const uint8_t* p, F& lo, F& hi) {
    __m128i b = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(15);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
  }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  // The 4-bit lookup (kernel_body.inc's q4g_tile_lut): lut[i] = fma(i, s, z), and
  // vpermps reads only an index's low 4 bits, so the zero-extended bytes index the
  // low nibbles as they are and the high ones after a shift.
  static constexpr bool kLut4 = true;
  static void h2f_n(const uint16_t* h, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_store_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
    for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
  }
  static F lut4(float s, float z) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(iota, _mm512_set1_ps(s), _mm512_set1_ps(z));
  }
  static void lookup4(const uint8_t* p, F lut, F& lo, F& hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = _mm512_permutexvar_ps(b, lut);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
  }
  static void prepare_act(const int8_t* xq, int64_t D, int64_t M, A* xqt) {
    for (int64_t d = 0; d < D; ++d)
      for (int64_t m = 0; m < M; ++m) xqt[m * D + d] = uint8_t(int(xq[d * M + m]) + 128);
  }
  // sum_d q (x + 128) - 128 sum_d q; the ragged tail by masked (zeroed) loads.
  template <int C>
  static void dot_i8(const int8_t* q, const A* xqt, int64_t D, int32_t* acc) {
    __m512i a[C], qsum = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1);
    for (int c = 0; c < C; ++c) a[c] = _mm512_setzero_si512();
    for (int64_t d = 0; d < D; d += 64) {
      __mmask64 k = D - d >= 64 ? ~__mmask64(0) : (__mmask64(1) << (D - d)) - 1;
      __m512i w = _mm512_maskz_loadu_epi8(k, q + d);
      qsum = _mm512_dpbusd_epi32(qsum, ones, w);
      for (int c = 0; c < C; ++c)
        a[c] = _mm512_dpbusd_epi32(a[c], _mm512_maskz_loadu_epi8(k, xqt + c * D + d), w);
    }
    int32_t corr = 128 * _mm512_reduce_add_epi32(qsum);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_reduce_add_epi32(a[c]) - corr;
  }
};
#include "kernel_body.inc"
#include "kernel_panel.inc"
}  // namespace avx512
#pragma GCC pop_options

int best_isa() {
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return 1;
    return 0;
  }();
  return level;
}

int pick_isa(int32_t requested) {
  return requested < 0 ? best_isa() : std::min<int>(requested, best_isa());
}

// The panel path (kernel_panel.inc) from this many columns on, per target (measured in
// this folder's __init__.py: 8 columns ran faster on the row tiles, 16 on the panels;
// f32 even at 8); quant_matmul_cpu.PANEL_COLUMNS repeats them (a test checks). The
// attribute panel: -1 this rule, 0 never, 1 always.
constexpr int64_t kPanelInt8 = 12, kPanelQ8g = 12, kPanelQ4g = 12, kPanelF32 = 8;

bool use_panel(int32_t panel, int64_t M, int64_t from) {
  return panel > 0 || (panel < 0 && M >= from);
}

// x [D, M] copied for the panel path at `level` (prepare_panel_x; perm4: int4's order).
std::vector<float> panel_x(int level, const float* x, int64_t D, int64_t M, bool perm4) {
  std::vector<float> xp;
  if (level == 2) {
    xp.resize(D * avx512::panel_cols(M));
    avx512::prepare_panel_x(x, D, M, perm4, xp.data());
  } else if (level == 1) {
    xp.resize(D * avx2::panel_cols(M));
    avx2::prepare_panel_x(x, D, M, perm4, xp.data());
  } else {
    xp.resize(D * scalar::panel_cols(M));
    scalar::prepare_panel_x(x, D, M, perm4, xp.data());
  }
  return xp;
}

ffi::Error F32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int32_t isa,
                   int32_t threads, int32_t panel) {
  Part wp = part(w.dimensions());
  if (!wp.L) return ffi::Error::InvalidArgument("jaxserve_qmm_f32: w [F, D] or [L, F, D]");
  const int64_t F = wp.dims[0], D = wp.dims[1], M = x.dimensions().back();
  if (auto e = check_x(D, x.dimensions()); e.failure()) return e;
  JS_LAYER("jaxserve_qmm_f32", wp.L)
  const float* wq = w.typed_data() + li * F * D;
  float* o = out->typed_data();
  const int level = pick_isa(isa);
  if (use_panel(panel, M, kPanelF32)) {
    const std::vector<float> xpb = panel_x(level, x.typed_data(), D, M, false);
    auto pn = [&, xp = xpb.data()](int64_t f0, int64_t f1) {
      if (level == 2) avx512::f32_panel(wq, xp, D, M, f0, f1, o);
      else if (level == 1) avx2::f32_panel(wq, xp, D, M, f0, f1, o);
      else scalar::f32_panel(wq, xp, D, M, f0, f1, o);
    };
    parallel_rows(pool, threads, F, F * D * M, pn);
    return ffi::Error::Success();
  }
  std::vector<float> xt(D * M);
  const float* xp = xt.data();
  auto fn = [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::f32_rows(wq, xp, D, M, f0, f1, o);
    else if (level == 1) avx2::f32_rows(wq, xp, D, M, f0, f1, o);
    else scalar::f32_rows(wq, xp, D, M, f0, f1, o);
  };
  scalar::prepare_x(x.typed_data(), D, M, xt.data());
  parallel_rows(pool, threads, F, F * D * M, fn);
  return ffi::Error::Success();
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> out, int32_t isa, int32_t threads,
                    int32_t panel) {
  Part qp_ = part(q.dimensions());
  if (!qp_.L || scale.element_count() != qp_.L * qp_.dims[0])
    return ffi::Error::InvalidArgument("jaxserve_qmm_int8: q [(L,) F, D], scale [(L,) F, 1]");
  const int64_t F = qp_.dims[0], D = qp_.dims[1], M = x.dimensions().back();
  if (auto e = check_x(D, x.dimensions()); e.failure()) return e;
  JS_LAYER("jaxserve_qmm_int8", qp_.L)
  const int8_t* qp = q.typed_data() + li * F * D;
  const float* sp = scale.typed_data() + li * F;
  float* o = out->typed_data();
  const int level = pick_isa(isa);
  if (use_panel(panel, M, kPanelInt8)) {
    const std::vector<float> xpb = panel_x(level, x.typed_data(), D, M, false);
    auto pn = [&, xp = xpb.data()](int64_t f0, int64_t f1) {
      if (level == 2) avx512::int8_panel(qp, sp, xp, D, M, f0, f1, o);
      else if (level == 1) avx2::int8_panel(qp, sp, xp, D, M, f0, f1, o);
      else scalar::int8_panel(qp, sp, xp, D, M, f0, f1, o);
    };
    parallel_rows(pool, threads, F, F * D * M, pn);
    return ffi::Error::Success();
  }
  std::vector<float> xt(D * M);
  const float* xp = xt.data();
  auto fn = [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::int8_rows(qp, sp, xp, D, M, f0, f1, o);
    else if (level == 1) avx2::int8_rows(qp, sp, xp, D, M, f0, f1, o);
    else scalar::int8_rows(qp, sp, xp, D, M, f0, f1, o);
  };
  scalar::prepare_x(x.typed_data(), D, M, xt.data());
  parallel_rows(pool, threads, F, F * D * M, fn);
  return ffi::Error::Success();
}

ffi::Error Q8gImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F16> scale,
                   ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                   ffi::ResultBuffer<ffi::F32> out, int32_t isa, int32_t threads,
                   int32_t panel) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions());
  if (!qp_.L || sp_.L != qp_.L || sp_.dims[0] != qp_.dims[0] || sp_.dims[1] < 1 ||
      qp_.dims[1] % sp_.dims[1])
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q8g: q [(L,) F, D], scale [(L,) F, G], G | D");
  const int64_t F = qp_.dims[0], D = qp_.dims[1], G = sp_.dims[1], M = x.dimensions().back(),
                gs = D / G;
  if (auto e = check_x(D, x.dimensions()); e.failure()) return e;
  JS_LAYER("jaxserve_qmm_q8g", qp_.L)
  (void)gs;
  q8g_matmul_x(pool, threads, pick_isa(isa), q.typed_data() + li * F * D,
               reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G,
               x.typed_data(), F, D, G, M, out->typed_data(), panel);
  return ffi::Error::Success();
}

void q8g_matmul_x(ffi::ThreadPool& pool, int32_t threads, int level, const int8_t* qp,
                  const uint16_t* s, const float* x, int64_t F, int64_t D, int64_t G, int64_t M,
                  float* o, int32_t panel) {
  const int64_t gs = D / G;
  if (level == 2 && gs % 16) level = 1;
  if (level == 1 && gs % 8) level = 0;
  if (use_panel(panel, M, kPanelQ8g)) {
    const std::vector<float> xpb = panel_x(level, x, D, M, false);
    auto pn = [&, xp = xpb.data()](int64_t f0, int64_t f1) {
      if (level == 2) avx512::q8g_panel(qp, s, xp, D, G, M, f0, f1, o);
      else if (level == 1) avx2::q8g_panel(qp, s, xp, D, G, M, f0, f1, o);
      else scalar::q8g_panel(qp, s, xp, D, G, M, f0, f1, o);
    };
    parallel_rows(pool, threads, F, F * D * M, pn);
    return;
  }
  std::vector<float> xt(D * M);
  const float* xp = xt.data();
  scalar::prepare_x(x, D, M, xt.data());
  auto fn = [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::q8g_rows(qp, s, xp, D, G, M, f0, f1, o);
    else if (level == 1) avx2::q8g_rows(qp, s, xp, D, G, M, f0, f1, o);
    else scalar::q8g_rows(qp, s, xp, D, G, M, f0, f1, o);
  };
  parallel_rows(pool, threads, F, F * D * M, fn);
}

ffi::Error Q4gImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> scale,
                   ffi::Buffer<ffi::F16> zero, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int32_t isa,
                   int32_t threads, int32_t panel) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions()), zp_ = part(zero.dimensions());
  const int64_t D = x.dimensions().front();
  if (!qp_.L || sp_.L != qp_.L || zp_.L != qp_.L || sp_.dims != zp_.dims ||
      sp_.dims[0] != qp_.dims[0] || D != 2 * qp_.dims[1] || sp_.dims[1] < 1 || D % sp_.dims[1] ||
      (D / sp_.dims[1]) % 2)
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q4g: q [(L,) F, D/2], scale and zero [(L,) F, G], x [D, M], even D / G");
  const int64_t F = qp_.dims[0], G = sp_.dims[1], M = x.dimensions().back(), gs = D / G;
  JS_LAYER("jaxserve_qmm_q4g", qp_.L)
  (void)gs;
  q4g_matmul_x(pool, threads, pick_isa(isa), q.typed_data() + li * F * (D / 2),
               reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G,
               reinterpret_cast<const uint16_t*>(zero.typed_data()) + li * F * G,
               x.typed_data(), F, D, G, M, out->typed_data(), panel);
  return ffi::Error::Success();
}

void q4g_matmul_x(ffi::ThreadPool& pool, int32_t threads, int level, const uint8_t* qp,
                  const uint16_t* s, const uint16_t* z, const float* x, int64_t F, int64_t D,
                  int64_t G, int64_t M, float* o, int32_t panel) {
  const int64_t gs = D / G;
  if (level == 2 && gs % 32) level = 1;
  if (level == 1 && gs % 16) level = 0;
  if (use_panel(panel, M, kPanelQ4g)) {
    const std::vector<float> xpb = panel_x(level, x, D, M, true);
    auto pn = [&, xp = xpb.data()](int64_t f0, int64_t f1) {
      if (level == 2) avx512::q4g_panel(qp, s, z, xp, D, G, M, f0, f1, o);
      else if (level == 1) avx2::q4g_panel(qp, s, z, xp, D, G, M, f0, f1, o);
      else scalar::q4g_panel(qp, s, z, xp, D, G, M, f0, f1, o);
    };
    parallel_rows(pool, threads, F, F * D * M, pn);
    return;
  }
  std::vector<float> xt(D * M);
  float* xp = xt.data();
  if (level == 2) avx512::prepare_x4(x, D, M, xp);
  else if (level == 1) avx2::prepare_x4(x, D, M, xp);
  else scalar::prepare_x4(x, D, M, xp);
  auto fn = [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::q4g_rows(qp, s, z, xp, D, G, M, f0, f1, o);
    else if (level == 1) avx2::q4g_rows(qp, s, z, xp, D, G, M, f0, f1, o);
    else scalar::q4g_rows(qp, s, z, xp, D, G, M, f0, f1, o);
  };
  parallel_rows(pool, threads, F, F * D * M, fn);
}

// Several 4-bit-group weights over the same x (a layer's q/k/v, or gate/up) in one
// call at row-tile widths: x prepared once, the parts' rows shared over the threads
// as one range. args: (q, scale, zero) per part as Q4gImpl's; rets: one [F_i, M]
// per part. The parts share D and G; each is read at layer[0] of its own stack.
ffi::Error Q4gPartsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, int32_t isa, int32_t threads,
                        int32_t act_block, int32_t act_bits) {
  constexpr int kMaxParts = 4;
  const int64_t n = int64_t(rets.size());
  if (n < 1 || n > kMaxParts || int64_t(args.size()) != 3 * n)
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q4g_parts: 1-4 parts, (q, scale, zero) each, one result each");
  const int64_t D = x.dimensions().front(), M = x.dimensions().back();
  if ((act_block != 0 && act_block != 32) || (act_block && D % 32) ||
      (act_block && act_bits != 8 && act_bits != 16))
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q4g_parts: act_block must be 0 or 32 (dividing D), act_bits 8 or 16");
  const uint8_t* qp[kMaxParts];
  const uint16_t *sp[kMaxParts], *zp[kMaxParts];
  float* op[kMaxParts];
  int64_t off[kMaxParts + 1] = {0}, G = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto q = args.get<ffi::Buffer<ffi::U8>>(3 * i);
    auto sc = args.get<ffi::Buffer<ffi::F16>>(3 * i + 1);
    auto ze = args.get<ffi::Buffer<ffi::F16>>(3 * i + 2);
    auto o = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (q.has_error() || sc.has_error() || ze.has_error() || o.has_error())
      return ffi::Error::InvalidArgument(
          "jaxserve_qmm_q4g_parts: a part is not (u8, f16, f16) -> f32");
    Part qp_ = part(q->dimensions()), sp_ = part(sc->dimensions()), zp_ = part(ze->dimensions());
    if (!qp_.L || sp_.L != qp_.L || zp_.L != qp_.L || sp_.dims != zp_.dims ||
        sp_.dims[0] != qp_.dims[0] || D != 2 * qp_.dims[1] || sp_.dims[1] < 1 ||
        D % sp_.dims[1] || (D / sp_.dims[1]) % 2 || (i > 0 && sp_.dims[1] != G) ||
        int64_t((*o)->element_count()) != qp_.dims[0] * M)
      return ffi::Error::InvalidArgument(
          "jaxserve_qmm_q4g_parts: each part q [(L,) F, D/2], scale and zero [(L,) F, G] "
          "with one G, x [D, M], even D / G, result [F, M]");
    G = sp_.dims[1];
    const int64_t F = qp_.dims[0];
    JS_LAYER("jaxserve_qmm_q4g_parts", qp_.L)
    qp[i] = q->typed_data() + li * F * (D / 2);
    sp[i] = reinterpret_cast<const uint16_t*>(sc->typed_data()) + li * F * G;
    zp[i] = reinterpret_cast<const uint16_t*>(ze->typed_data()) + li * F * G;
    op[i] = (*o)->typed_data();
    off[i + 1] = off[i] + F;
  }
  const int64_t gs = D / G;
  int level = pick_isa(isa);
  if (level == 2 && gs % 32) level = 1;
  if (level == 1 && gs % 16) level = 0;
  std::vector<float> xt(D * M);
  float* xp = xt.data();
  std::vector<float> xf;  // act_block (gguf_a8 / a16): x replaced by its blocks' values
  if (act_block) xf = fake_quantize_act_blocks(x.typed_data(), D, M, act_bits);
  const float* xs = act_block ? xf.data() : x.typed_data();
  if (level == 2) avx512::prepare_x4(xs, D, M, xp);
  else if (level == 1) avx2::prepare_x4(xs, D, M, xp);
  else scalar::prepare_x4(xs, D, M, xp);
  auto fn = [&](int64_t f0, int64_t f1) {  // rows of the parts laid end to end
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = std::max(f0, off[i]) - off[i], b = std::min(f1, off[i + 1]) - off[i];
      if (a >= b) continue;
      if (level == 2) avx512::q4g_rows(qp[i], sp[i], zp[i], xp, D, G, M, a, b, op[i]);
      else if (level == 1) avx2::q4g_rows(qp[i], sp[i], zp[i], xp, D, G, M, a, b, op[i]);
      else scalar::q4g_rows(qp[i], sp[i], zp[i], xp, D, G, M, a, b, op[i]);
    }
  };
  parallel_rows(pool, threads, off[n], off[n] * D * M, fn);
  return ffi::Error::Success();
}

ffi::Error W8a8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::S8> xq, ffi::Buffer<ffi::F32> sx,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int32_t isa,
                    int32_t threads) {
  Part qp_ = part(q.dimensions());
  if (!qp_.L || scale.element_count() != qp_.L * qp_.dims[0])
    return ffi::Error::InvalidArgument("jaxserve_qmm_w8a8: q [(L,) F, D], scale [(L,) F, 1]");
  const int64_t F = qp_.dims[0], D = qp_.dims[1], M = xq.dimensions().back();
  JS_LAYER("jaxserve_qmm_w8a8", qp_.L)
  if (auto e = check_x(D, xq.dimensions()); e.failure()) return e;
  if (sx.element_count() != M)
    return ffi::Error::InvalidArgument("jaxserve_qmm_w8a8: sx must be [1, M]");
  const int level = pick_isa(isa);
  const int8_t *qp = q.typed_data() + li * F * D, *xqp = xq.typed_data();
  const float *sp = scale.typed_data() + li * F, *sxp = sx.typed_data();
  float* o = out->typed_data();
  std::vector<int8_t> xqt8;
  std::vector<uint8_t> xqtu;
  if (level == 2) {
    xqtu.resize(D * M);
    avx512::V::prepare_act(xqp, D, M, xqtu.data());
  } else {
    xqt8.resize(D * M);
    scalar::V::prepare_act(xqp, D, M, xqt8.data());
  }
  auto fn = [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::w8a8_rows(qp, sp, xqtu.data(), sxp, D, M, f0, f1, o);
    else if (level == 1) avx2::w8a8_rows(qp, sp, xqt8.data(), sxp, D, M, f0, f1, o);
    else scalar::w8a8_rows(qp, sp, xqt8.data(), sxp, D, M, f0, f1, o);
  };
  parallel_rows(pool, threads, F, F * D * M / 4, fn);
  return ffi::Error::Success();
}

// f32 [F, D] of a stacked (or 2-D) 4-bit grouped weight's layer: q [(L,) F, D/2],
// scale and zero [(L,) F, G].
ffi::Error DequantQ4gImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> q,
                          ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                          int32_t isa, int32_t threads) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions()), zp_ = part(zero.dimensions());
  auto od = out->dimensions();
  if (!qp_.L || sp_.L != qp_.L || zp_.L != qp_.L || sp_.dims != zp_.dims || od.size() != 2 ||
      sp_.dims[0] != qp_.dims[0] || od[0] != qp_.dims[0] || od[1] != 2 * qp_.dims[1] ||
      sp_.dims[1] < 1 || od[1] % sp_.dims[1] || (od[1] / sp_.dims[1]) % 2)
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_dequant_q4g: q [(L,) F, D/2], scale and zero [(L,) F, G], out [F, D], "
        "even D / G");
  const int64_t F = qp_.dims[0], D = od[1], G = sp_.dims[1];
  JS_LAYER("jaxserve_qmm_dequant_q4g", qp_.L)
  const int level = pick_isa(isa);
  const uint8_t* qp = q.typed_data() + li * F * (D / 2);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G;
  const uint16_t* z = reinterpret_cast<const uint16_t*>(zero.typed_data()) + li * F * G;
  float* o = out->typed_data();
  parallel_rows(pool, threads, F, F * D, [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::q4g_dequant_rows(qp, s, z, D, G, f0, f1, o);
    else if (level == 1) avx2::q4g_dequant_rows(qp, s, z, D, G, f0, f1, o);
    else scalar::q4g_dequant_rows(qp, s, z, D, G, f0, f1, o);
  });
  return ffi::Error::Success();
}

// f32 [F, D] of a stacked (or 2-D) Q8_0-like weight's layer: q [(L,) F, D], scale
// [(L,) F, G].
ffi::Error DequantQ8gImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out, int32_t isa, int32_t threads) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions());
  auto od = out->dimensions();
  if (!qp_.L || sp_.L != qp_.L || od.size() != 2 || sp_.dims[0] != qp_.dims[0] ||
      od[0] != qp_.dims[0] || od[1] != qp_.dims[1] || sp_.dims[1] < 1 || od[1] % sp_.dims[1])
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_dequant_q8g: q [(L,) F, D], scale [(L,) F, G], out [F, D], G | D");
  const int64_t F = qp_.dims[0], D = od[1], G = sp_.dims[1];
  JS_LAYER("jaxserve_qmm_dequant_q8g", qp_.L)
  const int level = pick_isa(isa);
  const int8_t* qp = q.typed_data() + li * F * D;
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G;
  float* o = out->typed_data();
  parallel_rows(pool, threads, F, F * D, [&](int64_t f0, int64_t f1) {
    if (level == 2) avx512::q8g_dequant_rows(qp, s, D, G, f0, f1, o);
    else if (level == 1) avx2::q8g_dequant_rows(qp, s, D, G, f0, f1, o);
    else scalar::q8g_dequant_rows(qp, s, D, G, f0, f1, o);
  });
  return ffi::Error::Success();
}

}  // namespace jaxserve_qmm

#define JS_ATTRS .Attr<int32_t>("isa").Attr<int32_t>("threads")
#define JS_PANEL_ATTRS JS_ATTRS.Attr<int32_t>("panel")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmInt8, jaxserve_qmm::Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_PANEL_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ8g, jaxserve_qmm::Q8gImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_PANEL_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ4g, jaxserve_qmm::Q4gImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_PANEL_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ4gParts, jaxserve_qmm::Q4gPartsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets() JS_ATTRS.Attr<int32_t>("act_block")
                                  .Attr<int32_t>("act_bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmW8a8, jaxserve_qmm::W8a8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmF32, jaxserve_qmm::F32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_PANEL_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmDequantQ4g, jaxserve_qmm::DequantQ4gImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmDequantQ8g, jaxserve_qmm::DequantQ8gImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JS_ATTRS);
