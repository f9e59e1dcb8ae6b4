// XLA:CPU FFI handlers of gguf_a8 and gguf_a16: GGUF-style grouped weights (4-bit groups
// as jaxserve_qmm_q4g stores them, or Q8_0-like int8 groups as jaxserve_qmm_q8g) x
// activations quantized to int8 (a8) or int16 (a16) in blocks of the weight's group of 32
// inputs (quant_format.quantize_act_blocks: sx = amax * kActScale per (block, column),
// xq = clip(rint(x * (1 / sx)), -L, L) with L = 127 or 32767, all in f32) -> f32 [F, M]:
//
//   out[f, m] = sum_g s[f, g] sx[g, m] sum_{d in g} q[f, d] xq[d, m]
//             + z[f, g] sx[g, m] sum_{d in g} xq[d, m]          (q4g; Q8_0: no zero term)
//
// = W_dequantized @ (sx xq) up to f32 rounding; the inner sums are exact int32.
//
// Targets (registered by ffi.py, platform "cpu"; attributes isa and threads as kernel.cc's):
//   jaxserve_qmm_q4g_a8, jaxserve_qmm_q4g_a16
//       (q u8[(L,) F, D/2], scale f16[(L,) F, G], zero f16[(L,) F, G], x f32[D, M], layer s32[])
//   jaxserve_qmm_q8g_a8, jaxserve_qmm_q8g_a16
//       (q s8[(L,) F, D], scale f16[(L,) F, G], x f32[D, M], layer s32[])
// with D / G == 32 (the activation block is the weight's group).
//
// With AVX-512 VNNI and F % 16 == 0: the 16 int32 lanes of a zmm hold 16 output rows. A
// panel of 32 weight rows x all of D is repacked per thread into "VNNI order" (a8: for each
// group and quad k of 4 inputs, one 64-byte vector = 16 rows x 4 bytes; a16: for each pair
// k of 2 inputs, 16 rows x 2 int16) with its scales (and zeros) in f32; then per 4-column
// tile and group, 8 vpdpbusd (a8) or 16 vpdpwssd (a16) per row vector (weights x a
// broadcast of the column's 4 activation bytes) and an epilogue
// facc += cvt(iacc) (s sx) [+ z (sx sum xq)]. a8: 4-bit values 0..15 are vpdpbusd's unsigned
// operand and xq its signed one; Q8_0's signed weights take xq + 128 as the unsigned
// operand, and each group's accumulator starts at -128 sum q (once per panel), so no
// correction op runs per product. a16: weights and activations are both signed int16
// (vpdpwssd), so neither needs an offset.
//
// Measured on the 2-core AMD EPYC (Zen 4, AVX-512 VNNI, no AMX; one thread, median of 7,
// prototype of this code): at M = 32, 262-270 GOP/s-equivalent (2 F D M / t) for 4-bit
// groups and 248-291 for Q8_0 at SmolLM2's 576 x 576 ... 1536 x 576 shapes, against 116
// GFLOP/s of a register-blocked f32 FMA GEMM (2.3-2.6x; the LM head's 49152 x 576 Q8_0:
// 168 against 97); zmm FMA peak 117 GFLOP/s, vpdpbusd 470 GOP/s per core. Zen 4 issues
// one of vpdpbusd / vfmadd / vmulps per cycle, so each group's epilogue takes slots from
// the dot products: that caps 4-bit groups at ~73% of the vpdpbusd peak. vpdpwssd does half
// of vpdpbusd's products per instruction (32), still twice an FMA's 16.
//
// Below 12 columns, without AVX-512 VNNI or with a ragged F: x is replaced by its blocks'
// values (sx xq, the same f32 values as quant_format.fake_quantize_act_blocks) and
// kernel.cc's weight-only grouped matmul runs on them (the definition, up to f32
// rounding).

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernel_common.h"

namespace jaxserve_qmm {

// quant_format.act_levels(bits): a block's scale is its amax times 1/127 (int8) or
// 1/32767 (int16) rounded to f32.
constexpr float kActScale = float(1.0 / 127.0);
constexpr float kActScale16 = float(1.0 / 32767.0);

// Block-quantized activations (prepare_act, prepare_act16): int8 xq / xu [M][D] (a
// column's D bytes contiguous; xu = xq + 128) or int16 xw [M][D], sx and zs [G][Ms] (Ms =
// M rounded up to 16) with zs = sx * sum_{d in g} xq.
struct ActQ {
  int D = 0, M = 0, G = 0, Ms = 0;
  std::vector<int8_t> xq;
  std::vector<uint8_t> xu;
  std::vector<int16_t> xw;
  std::vector<float> sx, zs;
  ActQ(int D_, int M_, int bits) : D(D_), M(M_), G(D_ / 32), Ms((M_ + 15) & ~15) {
    if (bits == 16) {
      xw.resize(size_t(M) * D);
    } else {
      xq.resize(size_t(M) * D);
      xu.resize(size_t(M) * D);
    }
    sx.resize(size_t(G) * Ms);
    zs.resize(size_t(G) * Ms);
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include "kernel_a8_vnni.inc"
// (after: it uses kernel_a8_vnni.inc's transposes)
#include "kernel_a8_act.inc"
#pragma GCC pop_options

std::vector<float> fake_quantize_act_blocks(const float* x, int64_t D, int64_t M, int bits) {
  const float scale = bits == 16 ? kActScale16 : kActScale, lim = bits == 16 ? 32767.f : 127.f;
  std::vector<float> xf(size_t(D) * M);
  if (best_isa() == 2) {
    a8::fake_quantize_blocks(x, D, M, bits, xf.data());
    return xf;
  }
  for (int64_t g = 0; g < D / 32; ++g)
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      for (int64_t d = 32 * g; d < 32 * g + 32; ++d) amax = std::max(amax, std::fabs(x[d * M + m]));
      const float sx = amax > 0.f ? amax * scale : 1.f, inv = 1.f / sx;
      for (int64_t d = 32 * g; d < 32 * g + 32; ++d) {
        const float q = std::min(lim, std::max(-lim, std::nearbyint(x[d * M + m] * inv)));
        xf[d * M + m] = q * sx;
      }
    }
  return xf;
}

namespace {

// The VNNI panels from this many columns (below: the activations' int8 block values
// through kernel.cc's weight-only row tiles, which read the weights once per call
// instead of repacking them). The a8 targets serve every width, so Python needs no copy.
constexpr int64_t kA8Panel = 12;

// Threads split rows in whole 48-row chunks (parallel_rows), multiples of 16.
bool vnni_path(int32_t isa, int64_t F, int64_t M) {
  return pick_isa(isa) == 2 && F % 16 == 0 && M >= kA8Panel;
}

}  // namespace

// The activations' int8 (bits 8) or int16 (16) blocks for the VNNI tiles.
static void prepare(const float* x, ActQ& a, int bits) {
  if (bits == 16)
    a8::prepare_act16(x, a);
  else
    a8::prepare_act(x, a);
}

template <int Bits>
ffi::Error Q4gActImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F16> scale,
                      ffi::Buffer<ffi::F16> zero, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int32_t isa,
                      int32_t threads) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions()), zp_ = part(zero.dimensions());
  const int64_t D = x.dimensions().front();
  if (x.dimensions().size() != 2 || !qp_.L || sp_.L != qp_.L || zp_.L != qp_.L ||
      sp_.dims != zp_.dims || sp_.dims[0] != qp_.dims[0] || D != 2 * qp_.dims[1] ||
      D != 32 * sp_.dims[1])
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q4g_a8/a16: q [(L,) F, D/2], scale and zero [(L,) F, D/32], x [D, M]");
  const int64_t F = qp_.dims[0], G = sp_.dims[1], M = x.dimensions().back();
  JS_LAYER("jaxserve_qmm_q4g_a8/a16", qp_.L)
  const uint8_t* qp = q.typed_data() + li * F * (D / 2);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G;
  const uint16_t* z = reinterpret_cast<const uint16_t*>(zero.typed_data()) + li * F * G;
  float* o = out->typed_data();
  if (!vnni_path(isa, F, M)) {
    const std::vector<float> xf = fake_quantize_act_blocks(x.typed_data(), D, M, Bits);
    q4g_matmul_x(pool, threads, pick_isa(isa), qp, s, z, xf.data(), F, D, G, M, o);
    return ffi::Error::Success();
  }
  ActQ a{int(D), int(M), Bits};
  prepare(x.typed_data(), a, Bits);
  parallel_rows(pool, threads, F, F * D * M / 4,
                [&](int64_t f0, int64_t f1) { a8::q4g_rows<Bits == 16>(qp, s, z, a, f0, f1, o); });
  return ffi::Error::Success();
}

template <int Bits>
ffi::Error Q8gActImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F16> scale,
                      ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> out, int32_t isa, int32_t threads) {
  Part qp_ = part(q.dimensions()), sp_ = part(scale.dimensions());
  const int64_t D = x.dimensions().front();
  if (x.dimensions().size() != 2 || !qp_.L || sp_.L != qp_.L || sp_.dims[0] != qp_.dims[0] ||
      D != qp_.dims[1] || D != 32 * sp_.dims[1])
    return ffi::Error::InvalidArgument(
        "jaxserve_qmm_q8g_a8/a16: q [(L,) F, D], scale [(L,) F, D/32], x [D, M]");
  const int64_t F = qp_.dims[0], G = sp_.dims[1], M = x.dimensions().back();
  JS_LAYER("jaxserve_qmm_q8g_a8/a16", qp_.L)
  const int8_t* qp = q.typed_data() + li * F * D;
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scale.typed_data()) + li * F * G;
  float* o = out->typed_data();
  if (!vnni_path(isa, F, M)) {
    const std::vector<float> xf = fake_quantize_act_blocks(x.typed_data(), D, M, Bits);
    q8g_matmul_x(pool, threads, pick_isa(isa), qp, s, xf.data(), F, D, G, M, o);
    return ffi::Error::Success();
  }
  ActQ a{int(D), int(M), Bits};
  prepare(x.typed_data(), a, Bits);
  parallel_rows(pool, threads, F, F * D * M / 4,
                [&](int64_t f0, int64_t f1) { a8::q8g_rows<Bits == 16>(qp, s, a, f0, f1, o); });
  return ffi::Error::Success();
}

}  // namespace jaxserve_qmm

// One binding per (weight kind, activation bits): the weight's operands (WEIGHT_ARGS),
// then x, layer, the result and the attributes, which all four share.
#define JS_ACT_BIND(WEIGHT_ARGS)                                       \
  ffi::Ffi::Bind()                                                     \
      .Ctx<ffi::ThreadPool>() WEIGHT_ARGS.Arg<ffi::Buffer<ffi::F32>>() \
      .Arg<ffi::Buffer<ffi::S32>>()                                    \
      .Ret<ffi::Buffer<ffi::F32>>()                                    \
      .Attr<int32_t>("isa")                                            \
      .Attr<int32_t>("threads")
#define JS_Q4G_ACT_BIND                         \
  JS_ACT_BIND(.Arg<ffi::Buffer<ffi::U8>>()      \
                  .Arg<ffi::Buffer<ffi::F16>>() \
                  .Arg<ffi::Buffer<ffi::F16>>())
#define JS_Q8G_ACT_BIND JS_ACT_BIND(.Arg<ffi::Buffer<ffi::S8>>().Arg<ffi::Buffer<ffi::F16>>())

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ4gA8, jaxserve_qmm::Q4gActImpl<8>, JS_Q4G_ACT_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ4gA16, jaxserve_qmm::Q4gActImpl<16>, JS_Q4G_ACT_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ8gA8, jaxserve_qmm::Q8gActImpl<8>, JS_Q8G_ACT_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQmmQ8gA16, jaxserve_qmm::Q8gActImpl<16>, JS_Q8G_ACT_BIND);
