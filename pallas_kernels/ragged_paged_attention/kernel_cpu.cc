// XLA:CPU FFI handlers: the decode rows and the prefill rows of ragged paged attention,
// read from the pages in place (see kernel_cpu.py beside this file for the design and
// the tables).
//
// Targets jaxserve_rpa_prefill_f32 and _int8: the decode targets' arguments with
// cu_q_lens s32[S + 1] and num_seqs s32[] before num_decode; rows of sequences
// num_decode .. num_seqs - 1 (packed by cu_q_lens, causal, a sequence's q_len queries
// the last of its kv_len positions; kernel_cpu_prefill.inc), every other row 0.
//
// Targets jaxserve_rpa_decode_f32 and _int8 (platform "cpu"; registered by kernel_cpu.py):
//   q f32[T, N, H], k_pages, v_pages f32 or s8[P, L, K, H], k_scales, v_scales f32[P, L, K]
//   (int8: k = k_pages * k_scales; ignored for f32, pass [0]), kv_lens s32[S],
//   page_indices s32[S, PP], num_decode s32[], window s32[] -> o f32[T, N, H]
//   attributes sm_scale f32, soft_cap f32 (0: none), isa s32 (-1 best, 0 scalar,
//   1 AVX2+FMA, 2 AVX-512F), threads s32 (0: XLA's intra-op pool size).
// Rows 0 .. min(num_decode, S, T) - 1 are decode rows (query token = row); every other
// row of o is 0. Row r sees kv positions [max(0, kv_len - window), kv_len), clipped to
// its PP pages; page ids are clamped to [0, P) as XLA's gather clamps them.
//
// One work unit is (row, split): one pass over its positions page by page (a page's
// slots are one contiguous run; the next page is prefetched), per kv head the G query
// heads' scores, an online softmax (running max / sum, the accumulator rescaled once per
// page), partial (m, l, acc[K, G, H]) merged at the end (flash-decoding's split of the
// positions when there are fewer rows than threads can share). Built in the
// quant_matmul_cpu extension (setup.py).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxserve_rpa {

constexpr int kMaxG = 16;
constexpr int kMaxL = 256;

struct Unit {
  const float* q;  // [K, G, H], scaled by sm_scale
  const void* kp;  // float or int8_t [P, L, K, H]
  const void* vp;
  const float* ks;  // int8 pages' scales [P, L, K], else null
  const float* vs;
  const int32_t* pages;  // the row's page table
  int64_t P, L, K, H, G, lo, hi;
  float cap;
  float* m;    // [K, G]
  float* l;    // [K, G]
  float* acc;  // [K, G, H]
};

constexpr int64_t kTileKeys = 128;  // kv positions per prefill tile (whole pages, >= 1)
constexpr int64_t kUnitRows = 192;  // query vectors (tokens x G) per prefill unit, about

// A prefill work unit: tokens [tok0, tok0 + nt) of one sequence (query positions qp0 ..
// qp0 + nt - 1), kv head k, positions below hi, window from position - window + 1.
struct PUnit {
  const float* q;  // [T, N, H], unscaled
  const void* kp;  // float or int8_t [P, L, K, H]
  const void* vp;
  const float* ks;  // int8 pages' scales [P, L, K], else null
  const float* vs;
  const int32_t* pages;  // the sequence's page table
  int64_t P, L, K, H, G, k, tok0, nt, qp0, hi, window;
  float sm_scale, cap;
  float* o;  // [T, N, H]
};

namespace scalar {
struct V {
  using F = float;
  static constexpr int W = 1;
  static F zero() { return 0.f; }
  static F set1(float v) { return v; }
  static F load(const float* p) { return *p; }
  static F load(const int8_t* p) { return float(*p); }
  static void store(float* p, F a) { *p = a; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static float reduce(F a) { return a; }
  static F reduce16(const F* a) { return a[0]; }  // unused: only AVX-512 takes 16 at once
  static float max(const float* x, int64_t n) {  // max of x[0..n), n >= 1
    float r = x[0];
    for (int64_t j = 1; j < n; ++j) r = std::max(r, x[j]);
    return r;
  }
  static float exp_sub(float* x, int64_t n, float m) {  // x = exp(x - m); returns the sum
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += (x[j] = std::exp(x[j] - m));
    return sum;
  }
};
#include "kernel_cpu_body.inc"
#include "kernel_cpu_prefill.inc"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct V {
  using F = __m256;
  static constexpr int W = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float exp_sub(float* x, int64_t n, float m) {
    return scalar::V::exp_sub(x, n, m);
  }
  static float max(const float* x, int64_t n) { return scalar::V::max(x, n); }
  static F reduce16(const F* a) { return a[0]; }  // unused: only AVX-512 takes 16 at once
};
#include "kernel_cpu_body.inc"
#include "kernel_cpu_prefill.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
struct V {
  using F = __m512;
  static constexpr int W = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(F a) { return _mm512_reduce_add_ps(a); }
  // The 16 sums of a[0..15] as one vector (lane j: sum of a[j]): a tree of in-lane
  // and 128-bit shuffles, 31 adds and shuffles for 16 horizontal sums.
  static F reduce16(const F* a) {
    F b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; ++i)
      d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xee));
    const F e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                              _mm512_shuffle_ps(d[0], d[1], 0xdd));
    // lane 4 k + m holds the sum of a[4 m + k]
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, e);
  }
  // exp(x - m) for x <= m, 16 lanes: 2^n e^r with n = round((x - m) log2 e),
  // r = (x - m) - n ln 2 (two-part ln 2), e^r by its degree-6 Taylor polynomial
  // (|r| <= ln 2 / 2: relative error ~1e-7), 2^n by vscalefps (0 far below).
  static F exp16(F x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const F n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    F p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
  }
  static float max(const float* x, int64_t n) {  // max of x[0..n), n >= 1
    F r = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      r = _mm512_mask_max_ps(r, k, r, _mm512_maskz_loadu_ps(k, x + j));
    }
    return _mm512_reduce_max_ps(r);
  }
  static float exp_sub(float* x, int64_t n, float m) {
    F sum = _mm512_setzero_ps();
    const F mv = _mm512_set1_ps(m);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      const F e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), mv));
      _mm512_mask_storeu_ps(x + j, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
};
#include "kernel_cpu_body.inc"
#include "kernel_cpu_prefill.inc"
}  // namespace avx512
#pragma GCC pop_options

int best_isa() {
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
  }();
  return level;
}

// Units [0, n) over up to `threads` threads: the caller and tasks on XLA's intra-op
// pool take units from one counter (as quant_matmul_cpu's parallel_rows), so a busy
// pool costs parallelism, never a deadlock.
template <class Fn>
void parallel_units(ffi::ThreadPool& pool, int64_t nthreads, int64_t n, Fn fn) {
  if (nthreads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n;
    Fn fn;
    State(int64_t n_, Fn f) : n(n_), fn(f) {}
    void run() {
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto st = std::make_shared<State>(n, fn);
  for (int64_t t = 1; t < std::min(nthreads, n); ++t) pool.Schedule([st] { st->run(); });
  st->run();
  while (st->done.load(std::memory_order_acquire) < st->n) std::this_thread::yield();
}

template <ffi::DataType DT>
ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<DT> kpages, ffi::Buffer<DT> vpages,
                         ffi::Buffer<ffi::F32> kscales, ffi::Buffer<ffi::F32> vscales,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                         ffi::Buffer<ffi::S32> num_decode, ffi::Buffer<ffi::S32> window,
                         ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                         int32_t isa, int32_t threads) {
  auto qd = q.dimensions(), pd = kpages.dimensions(), id = page_indices.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || vpages.dimensions().size() != 4 || id.size() != 2 ||
      kv_lens.element_count() != id[0] || num_decode.element_count() != 1 ||
      window.element_count() != 1 || pd[3] != qd[2] || pd[2] < 1 || qd[1] % pd[2] ||
      qd[1] / pd[2] > kMaxG || pd[1] > kMaxL)
    return ffi::Error::InvalidArgument(
        "jaxserve_rpa_decode_f32: q [T, N, H], pages [P, L, K, H] (L <= 256, N = K G, "
        "G <= 16), kv_lens [S], page_indices [S, PP], num_decode and window scalars");
  for (int i = 0; i < 4; ++i)
    if (vpages.dimensions()[i] != pd[i])
      return ffi::Error::InvalidArgument("jaxserve_rpa_decode_f32: k and v pages differ");
  const int64_t T = qd[0], N = qd[1], H = qd[2], P = pd[0], L = pd[1], K = pd[2], G = N / K;
  const int64_t S = id[0], PP = id[1];
  constexpr bool i8 = DT == ffi::DataType::S8;
  if (i8 && (kscales.element_count() != P * L * K || vscales.element_count() != P * L * K))
    return ffi::Error::InvalidArgument("jaxserve_rpa_decode_int8: scales f32[P, L, K]");
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * N * H);
  const int64_t R = std::max<int64_t>(
      0, std::min<int64_t>({int64_t(num_decode.typed_data()[0]), S, T}));
  if (R == 0 || P == 0) return ffi::Error::Success();
  const int64_t W = std::max<int64_t>(1, window.typed_data()[0]);
  const int32_t* lens = kv_lens.typed_data();
  std::vector<int64_t> lo(R), hi(R);
  int64_t max_len = 0;
  for (int64_t r = 0; r < R; ++r) {
    hi[r] = std::clamp<int64_t>(lens[r], 0, PP * L);
    lo[r] = std::max<int64_t>(0, int64_t(lens[r]) - W);
    if (lo[r] > hi[r]) lo[r] = hi[r];
    max_len = std::max(max_len, hi[r] - lo[r]);
  }
  int64_t nthreads = pool.num_threads();
  if (threads > 0) nthreads = std::min<int64_t>(nthreads, threads);
  nthreads = std::max<int64_t>(nthreads, 1);
  // Split the positions when (row, kv head) pairs are too few to keep every thread
  // busy (4 units per thread), in page-aligned pieces of at least 16 pages.
  int64_t splits = 1;
  const int64_t pairs = R * K;
  if (nthreads > 1 && R < 4 * nthreads) {
    const int64_t want = (4 * nthreads + R - 1) / R;
    const int64_t most = std::max<int64_t>(1, max_len / (16 * L));
    splits = std::min(want, most);
    // Units in whole rounds of the threads: one row of ~1,000 positions (63 pages)
    // in 3 splits on 2 threads takes two split-times (2/3 of the row), in 2 one (1/2).
    while (splits > 1 && (R * splits) % nthreads) --splits;
  }
  const int64_t total = int64_t(R) * N * H * std::max<int64_t>(max_len, 1);
  if (total < (1 << 16)) nthreads = 1;  // too little work to share
  std::vector<float> qs(R * N * H);
  for (int64_t i = 0; i < R * N * H; ++i) qs[i] = q.typed_data()[i] * sm_scale;
  const int64_t nunits = R * splits;
  std::vector<float> m(nunits * N), l(nunits * N), acc(nunits * N * H);
  int level = isa < 0 ? best_isa() : std::min(int(isa), best_isa());
  if (level == 2 && H % 16) level = 1;
  if (level == 1 && H % 8) level = 0;
  const void* kp = kpages.typed_data();
  const void* vp = vpages.typed_data();
  const int32_t* pages = page_indices.typed_data();
  auto fn = [&](int64_t u) {
    const int64_t s = u % splits, r = u / splits;
    const int64_t n = hi[r] - lo[r];
    // page-aligned split points
    const int64_t first_page = lo[r] / L, last_page = (hi[r] + L - 1) / L;
    const int64_t np = last_page - first_page, per = (np + splits - 1) / splits;
    const int64_t p0 = first_page + s * per, p1 = std::min(last_page, p0 + per);
    Unit un;
    un.q = qs.data() + r * N * H;
    un.kp = kp;
    un.vp = vp;
    un.ks = i8 ? kscales.typed_data() : nullptr;
    un.vs = i8 ? vscales.typed_data() : nullptr;
    un.pages = pages + r * PP;
    un.P = P; un.L = L; un.K = K; un.H = H; un.G = G;
    un.lo = std::max(lo[r], p0 * L);
    un.hi = std::min(hi[r], p1 * L);
    un.cap = soft_cap;
    un.m = m.data() + u * N;
    un.l = l.data() + u * N;
    un.acc = acc.data() + u * N * H;
    for (int64_t g = 0; g < N; ++g) { un.m[g] = -INFINITY; un.l[g] = 0.f; }
    std::memset(un.acc, 0, sizeof(float) * N * H);
    if (n <= 0 || un.lo >= un.hi) return;
    using T = std::conditional_t<i8, int8_t, float>;
    if (level == 2) avx512::attend<T>(un);
    else if (level == 1) avx2::attend<T>(un);
    else scalar::attend<T>(un);
  };
  parallel_units(pool, nthreads, nunits, fn);
  // Merge the splits of each (row, kv head) and normalise.
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t r = pair / K, k = pair % K;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, m[(r * splits + s) * N + k * G + g]);
      if (mx == -INFINITY) continue;  // no visible position: 0
      float* dst = o + (r * N + k * G + g) * H;
      float lsum = 0.f;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t i = (r * splits + s) * N + k * G + g;
        if (l[i] == 0.f) continue;
        const float a = std::exp(m[i] - mx);
        lsum += a * l[i];
        const float* src = acc.data() + i * H;
        for (int64_t h = 0; h < H; ++h) dst[h] += a * src[h];
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      for (int64_t h = 0; h < H; ++h) dst[h] *= inv;
    }
  }
  return ffi::Error::Success();
}

// Prefill rows: sequences num_decode .. num_seqs - 1 packed by cu_q_lens; every other row
// of o is 0. Units (sequence, kv head, block of tokens) go longest first to the threads.
template <ffi::DataType DT>
ffi::Error PrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                       ffi::Buffer<DT> kpages, ffi::Buffer<DT> vpages,
                       ffi::Buffer<ffi::F32> kscales, ffi::Buffer<ffi::F32> vscales,
                       ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                       ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                       ffi::Buffer<ffi::S32> num_decode, ffi::Buffer<ffi::S32> window,
                       ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                       int32_t isa, int32_t threads) {
  auto qd = q.dimensions(), pd = kpages.dimensions(), id = page_indices.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || vpages.dimensions().size() != 4 || id.size() != 2 ||
      kv_lens.element_count() != id[0] || cu_q_lens.element_count() != id[0] + 1 ||
      num_seqs.element_count() != 1 || num_decode.element_count() != 1 ||
      window.element_count() != 1 || pd[3] != qd[2] || pd[2] < 1 || qd[1] % pd[2])
    return ffi::Error::InvalidArgument(
        "jaxserve_rpa_prefill: q [T, N, H], pages [P, L, K, H] (N = K G), kv_lens [S], "
        "page_indices [S, PP], cu_q_lens [S + 1], num_seqs, num_decode and window scalars");
  for (int i = 0; i < 4; ++i)
    if (vpages.dimensions()[i] != pd[i])
      return ffi::Error::InvalidArgument("jaxserve_rpa_prefill: k and v pages differ");
  const int64_t T = qd[0], N = qd[1], H = qd[2], P = pd[0], L = pd[1], K = pd[2], G = N / K;
  const int64_t S = id[0], PP = id[1];
  constexpr bool i8 = DT == ffi::DataType::S8;
  if (i8 && (kscales.element_count() != P * L * K || vscales.element_count() != P * L * K))
    return ffi::Error::InvalidArgument("jaxserve_rpa_prefill_int8: scales f32[P, L, K]");
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * N * H);
  const int64_t ns = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, S);
  const int64_t nd = std::max<int64_t>(0, num_decode.typed_data()[0]);
  if (P == 0 || L == 0 || H == 0) return ffi::Error::Success();
  const int64_t W = std::max<int64_t>(1, window.typed_data()[0]);
  const int32_t *lens = kv_lens.typed_data(), *cu = cu_q_lens.typed_data();
  const int64_t bq = std::max<int64_t>(1, kUnitRows / G);
  PUnit base;
  base.q = q.typed_data();
  base.kp = kpages.typed_data();
  base.vp = vpages.typed_data();
  base.ks = i8 ? kscales.typed_data() : nullptr;
  base.vs = i8 ? vscales.typed_data() : nullptr;
  base.P = P; base.L = L; base.K = K; base.H = H; base.G = G;
  base.window = W;
  base.sm_scale = sm_scale;
  base.cap = soft_cap;
  base.o = o;
  std::vector<PUnit> units;
  std::vector<int64_t> work;
  for (int64_t i = nd; i < ns; ++i) {
    const int64_t q0 = cu[i], q_len = int64_t(cu[i + 1]) - q0, kv_len = lens[i];
    const int64_t hi = std::clamp<int64_t>(kv_len, 0, PP * L);
    for (int64_t t0 = 0; t0 < q_len; t0 += bq) {
      const int64_t tok0 = q0 + t0, tok1 = std::min({q0 + q_len, tok0 + bq, T});
      if (tok0 < 0 || tok1 <= tok0) continue;
      const int64_t qp0 = kv_len - q_len + t0, nt = tok1 - tok0;
      const int64_t span = std::min(qp0 + nt, hi) - std::max<int64_t>(0, qp0 - W + 1);
      for (int64_t k = 0; k < K; ++k) {
        PUnit u = base;
        u.pages = page_indices.typed_data() + i * PP;
        u.k = k; u.tok0 = tok0; u.nt = nt; u.qp0 = qp0; u.hi = hi;
        units.push_back(u);
        work.push_back(std::max<int64_t>(span, 0) * nt);
      }
    }
  }
  std::vector<int64_t> order(units.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  int64_t total = 0;
  for (int64_t w : work) total += w;
  int64_t nthreads = pool.num_threads();
  if (threads > 0) nthreads = std::min<int64_t>(nthreads, threads);
  nthreads = std::max<int64_t>(nthreads, 1);
  if (total * G * H < (1 << 16)) nthreads = 1;  // too little work to share
  int level = isa < 0 ? best_isa() : std::min(int(isa), best_isa());
  if (level == 2 && H % 16) level = 1;
  if (level == 1 && H % 8) level = 0;
  using T8 = std::conditional_t<i8, int8_t, float>;
  parallel_units(pool, nthreads, int64_t(units.size()), [&](int64_t n) {
    const PUnit& u = units[order[n]];
    if (level == 2) avx512::prefill<T8>(u);
    else if (level == 1) avx2::prefill<T8>(u);
    else scalar::prefill<T8>(u);
  });
  return ffi::Error::Success();
}

}  // namespace jaxserve_rpa

// Both targets: q, K and V pages, K and V scales, then s32 operands (decode: kv_lens,
// page_indices, num_decode, window; prefill: kv_lens, page_indices, cu_q_lens,
// num_seqs, num_decode, window), one f32 result and the same attributes.
#define JS_RPA_HEAD(DT)                            \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Arg<ffi::Buffer<DT>>()                      \
      .Arg<ffi::Buffer<DT>>()                      \
      .Arg<ffi::Buffer<ffi::F32>>()                \
      .Arg<ffi::Buffer<ffi::F32>>()
#define JS_RPA_S32 .Arg<ffi::Buffer<ffi::S32>>()
#define JS_RPA_TAIL                                \
  .Ret<ffi::Buffer<ffi::F32>>()                    \
      .Attr<float>("sm_scale")                     \
      .Attr<float>("soft_cap")                     \
      .Attr<int32_t>("isa")                        \
      .Attr<int32_t>("threads")
#define JS_RPA_BIND(DT) JS_RPA_HEAD(DT) JS_RPA_S32 JS_RPA_S32 JS_RPA_S32 JS_RPA_S32 JS_RPA_TAIL
#define JS_RPA_PREFILL_BIND(DT) \
  JS_RPA_HEAD(DT) JS_RPA_S32 JS_RPA_S32 JS_RPA_S32 JS_RPA_S32 JS_RPA_S32 JS_RPA_S32 JS_RPA_TAIL

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRpaDecodeF32, jaxserve_rpa::DecodeImpl<ffi::F32>,
                              JS_RPA_BIND(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRpaDecodeInt8, jaxserve_rpa::DecodeImpl<ffi::S8>,
                              JS_RPA_BIND(ffi::S8));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRpaPrefillF32, jaxserve_rpa::PrefillImpl<ffi::F32>,
                              JS_RPA_PREFILL_BIND(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRpaPrefillInt8, jaxserve_rpa::PrefillImpl<ffi::S8>,
                              JS_RPA_PREFILL_BIND(ffi::S8));
