// TACO's per-column step as one XLA FFI handler for CPU.
//
// Bit for bit the same as taco_optax._column_step.reference_column_step on
// XLA:CPU: per row (one TACO column of m candidates),
//   c = (1 - mu) * g;  c[idx] = c[idx] + mu * decode(history)
//   top-k of |c| (ties to the lowest index), FP8 re-encode, r winners,
// with the whole gradient's finiteness deciding whether the history changes.
// Built at first use by taco_optax/_cpu_kernel.py with -ffp-contract=off: the
// reference rounds every product and sum separately, so no FMA here either.
//
// Inputs may carry leading batch axes (from jax.vmap): grads (B.., N, m),
// values/indices (B.., N, k), exponents (B.., N), mu and one_minus_mu (B..).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kExponentMask = 0x7f800000u;
// Candidates are screened in blocks: a block whose largest |c| cannot beat
// the current k-th entry is skipped without looking at its elements.
constexpr int64_t kBlock = 16;
// Rows handed to a thread at a time: about this many gradient entries.
constexpr int64_t kChunkElements = 1 << 16;

inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

inline float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

inline float Load(const float* p) { return *p; }
inline float Load(const uint16_t* p) { return FromBits(uint32_t(*p) << 16); }

// XLA:CPU runs its kernels with subnormals flushed to zero (inputs and
// results); the reference's arithmetic happens in that mode, so ours does too.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ | DAZ
#elif defined(__aarch64__)
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    asm volatile("msr fpcr, %0" : : "r"(fpcr | (uint64_t{1} << 24)));  // FZ
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  uint32_t saved_ = 0;
#endif
};

// float8_e4m3fn (bias 7, no infinities, 0x7f is NaN) to float32; exact.
inline float DecodeE4M3(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t exponent = (b >> 3) & 0xf;
  const uint32_t mantissa = b & 0x7;
  if ((b & 0x7f) == 0x7f) return FromBits(sign | 0x7fc00000u);
  if (exponent == 0) {
    const float magnitude = float(mantissa) * (1.0f / 512.0f);
    return sign ? -magnitude : magnitude;
  }
  return FromBits(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// float32 to float8_e4m3fn, round to nearest even, as XLA:CPU's convert:
// overflow past the largest finite (448) gives NaN (callers clip first).
inline uint8_t EncodeE4M3(float x) {
  const uint32_t bits = Bits(x);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & kAbsMask;
  if (magnitude > kExponentMask) return sign | 0x7f;  // NaN
  const int32_t exponent = int32_t(magnitude >> 23) - 127;
  if (exponent >= -6) {  // normal in e4m3: keep 3 of 23 mantissa bits
    const uint32_t odd = (magnitude >> 20) & 1;
    const uint32_t rounded = (magnitude + 0x7ffffu + odd) >> 20;
    const uint32_t code = rounded - (120u << 3);
    return code > 0x7e ? (sign | 0x7f) : uint8_t(sign | code);
  }
  // Subnormal in e4m3: a multiple of 2**-9.
  if (exponent < -10 || (magnitude >> 23) == 0) return sign;
  const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  const int32_t shift = 14 - exponent;  // 21 .. 24
  uint32_t quotient = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (quotient & 1))) ++quotient;
  return uint8_t(sign | quotient);
}

// 2**e as float32, or 0 below the normal range (XLA flushes 2**-127 to 0).
inline float Pow2(int32_t e) {
  return e < -126 ? 0.0f : FromBits(uint32_t(e + 127) << 23);
}

// Everything one call needs, shared by the threads.
struct Problem {
  const void* grads;
  bool grads_bf16;
  const uint8_t* values;
  const void* indices;
  bool indices_int16;
  const int8_t* exponents;
  const float* mu;
  const float* one_minus_mu;
  int64_t batch, rows, m, k, r;
  uint8_t* new_values;
  int8_t* new_exponents;
  void* new_indices;
  int32_t* winner_indices;
  float* winner_signs;
  std::unique_ptr<std::atomic<bool>[]> nonfinite;  // per batch entry
};

inline int64_t HistoryIndex(const Problem& p, int64_t offset) {
  return p.indices_int16 ? int64_t(static_cast<const int16_t*>(p.indices)[offset])
                         : int64_t(static_cast<const int32_t*>(p.indices)[offset]);
}

// Per-thread scratch, allocated once per thread and call, never per row.
struct Scratch {
  explicit Scratch(const Problem& p)
      : candidates(p.m), block_max((p.m + kBlock - 1) / kBlock),
        block_order(block_max.size()), survivors(p.m), positions(p.k) {}
  std::vector<float> candidates;
  std::vector<uint32_t> block_max;    // largest |c| bits per block
  std::vector<uint32_t> block_order;  // for the k-th largest block maximum
  std::vector<uint64_t> survivors;    // (|c| bits << 32) | ~position
  std::vector<int32_t> positions;     // the selected row positions
};

// c = (1 - mu) * g for one row, with per-block maxima of |c| bits; returns
// whether some gradient entry is NaN or infinite.
template <typename G>
bool ScaleRow(const G* row, int64_t m, float one_minus_mu, float* candidates,
              uint32_t* block_max) {
  uint32_t nonfinite = 0;
  for (int64_t start = 0; start < m; start += kBlock) {
    const int64_t size = std::min(kBlock, m - start);
    uint32_t largest = 0;
    for (int64_t t = 0; t < size; ++t) {
      const float g = Load(row + start + t);
      nonfinite |= uint32_t((Bits(g) & kExponentMask) == kExponentMask);
      const float c = one_minus_mu * g;
      candidates[start + t] = c;
      const uint32_t key = Bits(c) & kAbsMask;
      largest = key > largest ? key : largest;
    }
    block_max[start / kBlock] = largest;
  }
  return nonfinite != 0;
}

// Gathers (|c| bits << 32 | ~position) of the entries >= threshold in blocks
// whose maximum is >= threshold, without branching per entry; returns how
// many. Descending order of these keys is lax.top_k's order.
int64_t Gather(int64_t m, uint32_t threshold, Scratch& s) {
  uint64_t* survivors = s.survivors.data();
  int64_t count = 0;
  for (int64_t block = 0; block * kBlock < m; ++block) {
    if (s.block_max[block] < threshold) continue;
    const int64_t end = std::min((block + 1) * kBlock, m);
    for (int64_t j = block * kBlock; j < end; ++j) {
      const uint32_t key = Bits(s.candidates[j]) & kAbsMask;
      survivors[count] = (uint64_t(key) << 32) | (0xffffffffu - uint32_t(j));
      count += key >= threshold;
    }
  }
  return count;
}

// Positions of the k largest |candidates|, in decreasing order, ties to the
// lower position. Any T with at least k entries >= T bounds the k-th largest
// from below, so only entries >= T need sorting. The history gives such a T
// for free (its k merged entries; in steady state they are near the top);
// when it leaves too many blocks, the k-th largest block maximum is one too.
void Select(int64_t m, int64_t k, uint32_t history_bound, Scratch& s) {
  const int64_t blocks = (m + kBlock - 1) / kBlock;
  uint32_t threshold = history_bound;
  if (blocks > 2 * k) {
    int64_t open = 0;
    for (int64_t block = 0; block < blocks; ++block) {
      open += s.block_max[block] >= threshold;
    }
    if (open > 2 * k) {
      std::copy(s.block_max.begin(), s.block_max.end(), s.block_order.begin());
      std::nth_element(s.block_order.begin(), s.block_order.begin() + (k - 1),
                       s.block_order.end(), std::greater<uint32_t>());
      threshold = std::max(threshold, s.block_order[k - 1]);
    }
  }
  int64_t count = Gather(m, threshold, s);
  // Fewer than k only if the history had repeated positions: take everything.
  if (count < k) count = Gather(m, 0, s);
  uint64_t* survivors = s.survivors.data();
  auto larger = std::greater<uint64_t>();
  if (count > k) {
    std::nth_element(survivors, survivors + (k - 1), survivors + count, larger);
  }
  std::sort(survivors, survivors + k, larger);
  for (int64_t slot = 0; slot < k; ++slot) {
    s.positions[slot] = int32_t(0xffffffffu - uint32_t(survivors[slot]));
  }
}

void StepRow(const Problem& p, int64_t row, Scratch& s) {
  const int64_t m = p.m, k = p.k, r = p.r;
  const int64_t entry = row / p.rows;  // batch entry of this row
  float* candidates = s.candidates.data();
  const bool nonfinite =
      p.grads_bf16
          ? ScaleRow(static_cast<const uint16_t*>(p.grads) + row * m, m,
                     p.one_minus_mu[entry], candidates, s.block_max.data())
          : ScaleRow(static_cast<const float*>(p.grads) + row * m, m,
                     p.one_minus_mu[entry], candidates, s.block_max.data());
  if (nonfinite) p.nonfinite[entry].store(true, std::memory_order_relaxed);

  // Add the decayed history; the block maxima stay upper bounds.
  uint32_t history_bound = 0xffffffffu;  // smallest merged |c| bits
  const float mu = p.mu[entry];
  const float scale = Pow2(p.exponents[row]);
  for (int64_t slot = 0; slot < k; ++slot) {
    const int64_t j = HistoryIndex(p, row * k + slot);
    if (j < 0 || j >= m) {  // never produced; keeps memory safe
      history_bound = 0;
      continue;
    }
    const float previous = DecodeE4M3(p.values[row * k + slot]) * scale;
    candidates[j] = candidates[j] + mu * previous;
    const uint32_t key = Bits(candidates[j]) & kAbsMask;
    uint32_t& largest = s.block_max[j / kBlock];
    largest = key > largest ? key : largest;
    history_bound = std::min(history_bound, key);
  }

  Select(m, k, history_bound, s);

  // Encode: the largest |value| goes to [2**7, 2**8) (frexp exponent - 8).
  const uint32_t top = Bits(candidates[s.positions[0]]) & kAbsMask;
  const int32_t frexp_exponent =
      (top == 0 || top >= kExponentMask) ? 0 : int32_t(top >> 23) - 126;
  const int32_t exponent = std::clamp(frexp_exponent - 8, -126, 119);
  const float inverse_scale = Pow2(-exponent);
  p.new_exponents[row] = int8_t(exponent);
  for (int64_t slot = 0; slot < k; ++slot) {
    const int32_t j = s.positions[slot];
    const float value = candidates[j];
    float scaled = value * inverse_scale;
    scaled = scaled > 448.0f ? 448.0f : (scaled < -448.0f ? -448.0f : scaled);
    p.new_values[row * k + slot] = EncodeE4M3(scaled);
    if (p.indices_int16) {
      static_cast<int16_t*>(p.new_indices)[row * k + slot] = int16_t(j);
    } else {
      static_cast<int32_t*>(p.new_indices)[row * k + slot] = j;
    }
    if (slot < r) {
      p.winner_indices[row * r + slot] = j;
      p.winner_signs[row * r + slot] =
          value > 0.0f ? 1.0f : (value < 0.0f ? -1.0f : value);
    }
  }
}

// Rows are claimed in chunks from a shared counter by the calling thread and
// by helpers on XLA's pool. The caller only waits for chunks already claimed,
// so a pool that runs tasks late, inline or never cannot deadlock.
struct Work {
  Problem problem;
  int64_t chunk_rows = 1, chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void Run() {
    std::unique_ptr<Scratch> scratch;
    FlushDenormals flush;
    for (;;) {
      const int64_t chunk = next.fetch_add(1, std::memory_order_relaxed);
      if (chunk >= chunks) return;
      if (!scratch) scratch = std::make_unique<Scratch>(problem);
      const int64_t total = problem.batch * problem.rows;
      const int64_t end = std::min(total, (chunk + 1) * chunk_rows);
      for (int64_t row = chunk * chunk_rows; row < end; ++row) {
        StepRow(problem, row, *scratch);
      }
      finished.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

ffi::Error ColumnStep(ffi::ThreadPool pool, ffi::AnyBuffer grads,
                      ffi::AnyBuffer values, ffi::AnyBuffer indices,
                      ffi::Buffer<ffi::S8> exponents, ffi::Buffer<ffi::F32> mu,
                      ffi::Buffer<ffi::F32> one_minus_mu, int64_t update_topk,
                      ffi::Result<ffi::AnyBuffer> new_values,
                      ffi::Result<ffi::Buffer<ffi::S8>> new_exponents,
                      ffi::Result<ffi::AnyBuffer> new_indices,
                      ffi::Result<ffi::Buffer<ffi::S32>> winner_indices,
                      ffi::Result<ffi::Buffer<ffi::F32>> winner_signs,
                      ffi::Result<ffi::Buffer<ffi::PRED>> finite) {
  const auto grad_dims = grads.dimensions();
  const auto value_dims = values.dimensions();
  if (grad_dims.size() < 2 || value_dims.size() != grad_dims.size()) {
    return ffi::Error::InvalidArgument("taco column step: bad ranks");
  }
  const bool bf16 = grads.element_type() == ffi::DataType::BF16;
  if (!bf16 && grads.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("taco column step: grads not f32/bf16");
  }
  if (values.element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("taco column step: values not e4m3fn");
  }
  const bool int16 = indices.element_type() == ffi::DataType::S16;
  if (!int16 && indices.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("taco column step: indices not s32/s16");
  }
  const size_t rank = grad_dims.size();
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
  p.batch = 1;
  for (size_t axis = 0; axis + 2 < rank; ++axis) p.batch *= grad_dims[axis];
  p.rows = grad_dims[rank - 2];
  p.m = grad_dims[rank - 1];
  p.k = value_dims[rank - 1];
  p.r = update_topk;
  if (p.k < 1 || p.k > p.m || p.r < 1 || p.r > p.k ||
      indices.element_count() != values.element_count() ||
      size_t(p.batch * p.rows) != exponents.element_count() ||
      size_t(p.batch) != mu.element_count() ||
      size_t(p.batch) != one_minus_mu.element_count()) {
    return ffi::Error::InvalidArgument("taco column step: bad shapes");
  }
  p.grads = grads.untyped_data();
  p.grads_bf16 = bf16;
  p.values = static_cast<const uint8_t*>(values.untyped_data());
  p.indices = indices.untyped_data();
  p.indices_int16 = int16;
  p.exponents = exponents.typed_data();
  p.mu = mu.typed_data();
  p.one_minus_mu = one_minus_mu.typed_data();
  p.new_values = static_cast<uint8_t*>(new_values->untyped_data());
  p.new_exponents = new_exponents->typed_data();
  p.new_indices = new_indices->untyped_data();
  p.winner_indices = winner_indices->typed_data();
  p.winner_signs = winner_signs->typed_data();
  p.nonfinite = std::make_unique<std::atomic<bool>[]>(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) p.nonfinite[b].store(false);

  const int64_t total_rows = p.batch * p.rows;
  work->chunk_rows = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(p.m, 1));
  work->chunks = (total_rows + work->chunk_rows - 1) / work->chunk_rows;
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads(), work->chunks) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([work] { work->Run(); });
  }
  work->Run();
  while (work->finished.load(std::memory_order_acquire) < work->chunks) {
    std::this_thread::yield();
  }

  // A non-finite gradient keeps its history exactly.
  const int64_t per_entry = p.rows * p.k;
  const size_t index_bytes = int16 ? 2 : 4;
  for (int64_t b = 0; b < p.batch; ++b) {
    const bool bad = p.nonfinite[b].load();
    finite->typed_data()[b] = !bad;
    if (!bad) continue;
    std::memcpy(p.new_values + b * per_entry, p.values + b * per_entry,
                per_entry);
    std::memcpy(p.new_exponents + b * p.rows, p.exponents + b * p.rows, p.rows);
    std::memcpy(static_cast<char*>(p.new_indices) + b * per_entry * index_bytes,
                static_cast<const char*>(p.indices) + b * per_entry * index_bytes,
                per_entry * index_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoColumnStep, ColumnStep,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("update_topk")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());
