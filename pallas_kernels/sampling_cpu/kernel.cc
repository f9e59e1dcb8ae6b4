// XLA:CPU FFI handler of greedy sampling's statistics, one pass over each row of logits
// (sampling_cpu/__init__.py beside this file has the design; built into the
// quant_matmul_cpu extension by setup.py).
//
// Target jaxserve_greedy_f32 (platform "cpu"):
//   logits f32[S, V] -> ids s32[S], logprobs f32[S]
//   attributes isa s32 (-1 best, 0 scalar, 2 AVX-512F), threads s32 (0: XLA's pool).
// Row s: ids[s] = the first index of the row's largest value (a NaN counts as larger
// than any number, the first NaN wins: jnp.argmax's rule), logprobs[s] =
// (x[id] - max) - log(sum_v exp(x_v - max)), jax.nn.log_softmax's value at id.
// Rows of V = 0 give id 0 and logprob NaN.

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxserve_sampling {

struct RowStats {
  int64_t id;
  float max, sum;  // sum of exp(x - max)
};

// The first index of the largest value, NaN the largest (first NaN wins).
inline void argmax_scalar(const float* x, int64_t lo, int64_t hi, int64_t& id, float& mx) {
  for (int64_t v = lo; v < hi; ++v) {
    if (std::isnan(x[v])) {
      if (!std::isnan(mx)) { mx = x[v]; id = v; }
      return;  // nothing after the first NaN can win
    }
    if (x[v] > mx) { mx = x[v]; id = v; }
  }
}

namespace scalar {
inline RowStats row(const float* x, int64_t V) {
  int64_t id = 0;
  float mx = -std::numeric_limits<float>::infinity();
  argmax_scalar(x, 0, V, id, mx);
  double sum = 0.0;  // one running sum of up to ~1e5 terms: f32 would drift ~1e-5
  for (int64_t v = 0; v < V; ++v) sum += std::exp(x[v] - mx);
  return {id, mx, float(sum)};
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
// exp(x) for x <= 0, 16 lanes: 2^n e^r, n = round(x log2 e), r = x - n ln 2 (two-part
// ln 2), e^r by its degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error ~1e-7),
// 2^n by vscalefps (0 far below); NaN stays NaN.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // a NaN in x stays (the second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline RowStats row(const float* x, int64_t V) {
  const int64_t Vv = V / 16 * 16;
  // Pass 1: the max, lane by lane (a NaN lane stays NaN: max(x, m) returns x then).
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t v = 0; v < Vv; v += 16) {
    const __m512 xv = _mm512_loadu_ps(x + v);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, xv);
  }
  int64_t id = 0;
  float mx = -std::numeric_limits<float>::infinity();
  if (nan) {  // rare: the scalar rule finds the first NaN
    argmax_scalar(x, 0, V, id, mx);
  } else {
    if (Vv > 0) {
      mx = _mm512_reduce_max_ps(m);
      // The first index holding it (none while the block is all -inf: id 0).
      const __m512 mv = _mm512_set1_ps(mx);
      for (int64_t v = 0; v < Vv && mx != -std::numeric_limits<float>::infinity(); v += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + v), mv, _CMP_EQ_OQ);
        if (k) { id = v + __builtin_ctz(k); break; }
      }
    }
    argmax_scalar(x, Vv, V, id, mx);  // the tail: only a larger value or a NaN wins
  }
  // Pass 2: sum of exp(x - max).
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t v = 0;
  for (; v + 32 <= Vv; v += 32) {
    s0 = _mm512_add_ps(s0, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + v), mv)));
    s1 = _mm512_add_ps(s1, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + v + 16), mv)));
  }
  for (; v < V; v += 16) {
    const __mmask16 k = V - v >= 16 ? __mmask16(0xffff) : __mmask16((1u << (V - v)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + v), mv));
    s0 = _mm512_mask_add_ps(s0, k, s0, e);
  }
  return {id, mx, _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))};
}
}  // namespace avx512
#pragma GCC pop_options

int best_isa() {
  static const int level = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") ? 2 : 0;
  }();
  return level;
}

ffi::Error GreedyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::ResultBuffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> logprobs,
                      int32_t isa, int32_t threads) {
  auto d = logits.dimensions();
  if (d.size() != 2 || int64_t(ids->element_count()) != d[0] ||
      int64_t(logprobs->element_count()) != d[0])
    return ffi::Error::InvalidArgument(
        "jaxserve_greedy_f32: logits [S, V] -> ids [S], logprobs [S]");
  const int64_t S = d[0], V = d[1];
  const float* x = logits.typed_data();
  int32_t* out_ids = ids->typed_data();
  float* out_lp = logprobs->typed_data();
  const bool wide = (isa < 0 || isa >= 2) && best_isa() >= 2;
  auto fn = [&](int64_t s) {
    const float* xr = x + s * V;
    const RowStats r = wide ? avx512::row(xr, V) : scalar::row(xr, V);
    out_ids[s] = int32_t(r.id);
    out_lp[s] = V > 0 ? (xr[r.id] - r.max) - std::log(r.sum)
                      : std::numeric_limits<float>::quiet_NaN();
  };
  int64_t n = pool.num_threads();
  if (threads > 0) n = std::min<int64_t>(n, threads);
  if (n <= 1 || S <= 1 || S * V < (1 << 16)) {
    for (int64_t s = 0; s < S; ++s) fn(s);
    return ffi::Error::Success();
  }
  // Rows over the caller and tasks on XLA's intra-op pool, from one counter (a busy
  // pool costs parallelism, never a deadlock).
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto run = [st, S, &fn] {
    for (int64_t s; (s = st->next.fetch_add(1)) < S;) {
      fn(s);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(n, S); ++t) pool.Schedule([run] { run(); });
  run();
  while (st->done.load(std::memory_order_acquire) < S) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace jaxserve_sampling

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGreedyF32, jaxserve_sampling::GreedyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("threads"));
