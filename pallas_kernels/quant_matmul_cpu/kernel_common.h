// What the library's matmul sources share (kernel.cc, kernel_a8.cc): the thread split,
// the operand checks, the ISA level, and kernel.cc's weight-only grouped matmuls that
// kernel_a8.cc falls back on without AVX-512 VNNI.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxserve_qmm {

// The vector level this CPU runs (2 AVX-512 F/BW/VL/VNNI, 1 AVX2+FMA+F16C, 0 scalar), and
// the level to use for an `isa` attribute (-1 the best, else at most that).
int best_isa();
int pick_isa(int32_t requested);

// Rows [0, F) in chunks over up to `threads` threads: the caller and tasks on
// XLA's intra-op pool take chunks from one counter, so no chunk waits on a
// task that has not started (a busy or absent pool only costs parallelism).
// Below kMinWork multiply-adds one thread does it all (2^16: SmolLM2's 192 x 576 k/v
// projections at one column split over 2 threads took 6-7% off 30 layers' seven
// projections against 2^18, which kept them on one).
constexpr int64_t kMinWork = 1 << 16;

template <class Fn>
void parallel_rows(ffi::ThreadPool& pool, int32_t threads, int64_t F, int64_t work, Fn fn) {
  int64_t n = pool.num_threads();
  if (threads > 0) n = std::min<int64_t>(n, threads);
  if (n <= 1 || work < kMinWork || F < 32) {
    fn(0, F);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t chunks, rows;
    Fn fn;
    State(int64_t c, int64_t r, Fn f) : chunks(c), rows(r), fn(f) {}
    void run(int64_t F) {
      for (int64_t i; (i = next.fetch_add(1)) < chunks;) {
        fn(i * rows, std::min(F, (i + 1) * rows));
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  // chunks of whole 48-row blocks: whole panels at every ISA (12, 6, 4 rows) and tiles
  const int64_t rows = std::max<int64_t>(48, (F / (4 * n) + 47) / 48 * 48);
  auto st = std::make_shared<State>((F + rows - 1) / rows, rows, fn);
  for (int64_t t = 1; t < n; ++t) pool.Schedule([st, F] { st->run(F); });
  st->run(F);
  while (st->done.load(std::memory_order_acquire) < st->chunks) std::this_thread::yield();
}

inline ffi::Error check_x(int64_t D, ffi::Span<const int64_t> xdims) {
  if (xdims.size() != 2 || xdims[0] != D)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: x must be [D, M] with D of the weight");
  return ffi::Error::Success();
}

// The last two dims of a weight part of rank 2 ([F, C]) or 3 ([L, F, C], stacked
// over layers) as a rank-2 span, and L (1 for rank 2); L = 0 for another rank.
struct Part {
  int64_t L = 0;
  std::vector<int64_t> dims;
};
inline Part part(ffi::Span<const int64_t> d) {
  Part p;
  if (d.size() == 2 || d.size() == 3) {
    p.L = d.size() == 3 ? d[0] : 1;
    p.dims = {d[d.size() - 2], d[d.size() - 1]};
  }
  return p;
}

// The layer to read: layer[0] when 0 <= it < L, else -1.
inline int64_t layer_index(ffi::Buffer<ffi::S32>& layer, int64_t L) {
  if (layer.element_count() != 1) return -1;
  const int64_t i = layer.typed_data()[0];
  return i >= 0 && i < L ? i : -1;
}

#define JS_LAYER(NAME, L)                                                         \
  const int64_t li = layer_index(layer, L);                                       \
  if (li < 0)                                                                     \
    return ffi::Error::InvalidArgument(NAME                                       \
                                       ": layer must be a scalar in [0, L) of a " \
                                       "stacked weight (0 for a 2-D one)");

// kernel.cc's weight-only grouped matmuls of f32 x [D, M] (`panel` and `level` as the
// targets' attributes: -1 the panel path from its kPanel* columns, else the row tiles;
// level as pick_isa gives it): 4-bit groups (q [F, D/2],
// scale and zero f16 [F, G]) and Q8_0-like groups (q [F, D], scale f16 [F, G]); out [F, M].
void q4g_matmul_x(ffi::ThreadPool& pool, int32_t threads, int level, const uint8_t* q,
                  const uint16_t* s, const uint16_t* z, const float* x, int64_t F, int64_t D,
                  int64_t G, int64_t M, float* out, int32_t panel = -1);
void q8g_matmul_x(ffi::ThreadPool& pool, int32_t threads, int level, const int8_t* q,
                  const uint16_t* s, const float* x, int64_t F, int64_t D, int64_t G, int64_t M,
                  float* out, int32_t panel = -1);

// x f32 [D, M] with every block of 32 inputs of a column replaced by its int8 (bits 8) or
// int16 (bits 16) values sx * xq (quant_format.fake_quantize_act_blocks: the same f32
// products and rint), the activations gguf_a8 / gguf_a16 multiply; D % 32 == 0. Defined
// in kernel_a8.cc.
std::vector<float> fake_quantize_act_blocks(const float* x, int64_t D, int64_t M, int bits);

}  // namespace jaxserve_qmm
