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
// numerics.h holds the float helpers, masks.h the SIMD screening.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>


#include "masks.h"
#include "numerics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace taco_kernel {
namespace {

// Blocks of 16 entries screened per mask call.
constexpr int64_t kChunkBlocks = 2;
// Rows handed to a thread at a time: about this many gradient entries.
constexpr int64_t kChunkElements = 1 << 16;

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
  if (p.indices_int16) {
    return static_cast<const int16_t*>(p.indices)[offset];
  }
  return static_cast<const int32_t*>(p.indices)[offset];
}


// An entry's rank key: descending order of (|c| bits, -position) is
// lax.top_k's order (larger magnitude first, ties to the lower position).
inline uint64_t RankKey(float c, int64_t position) {
  return (uint64_t(Bits(c) & kAbsMask) << 32) |
         (0xffffffffu - uint32_t(position));
}
inline int32_t RankPosition(uint64_t key) {
  return int32_t(0xffffffffu - uint32_t(key));
}

// Per-thread scratch, allocated once per thread and call, never per row.
struct Scratch {
  explicit Scratch(const Problem& p)
      : slot_of(p.m, -1), merged(p.k), best(p.k) {}
  std::vector<int32_t> slot_of;  // history slot of a row position, or -1
  std::vector<float> merged;     // (1 - mu) g + mu * history, per slot
  std::vector<uint64_t> best;    // rank keys of the best k so far
  uint16_t masks[kChunkBlocks];
};

// Up to this k the best keys are kept sorted (an insertion moves few keys
// and the result needs no sort); above it in a min-heap.
constexpr int64_t kSortedLimit = 32;

// The best k rank keys seen so far. Once k are held the floor is the k-th
// best, so it rises with every insertion and screens out the rest of the row;
// a fresh gradient (history from another step) then costs few insertions
// instead of one per entry above the history's smallest value.
class TopK {
 public:
  TopK(int64_t k, uint64_t* keys) : k_(k), keys_(keys) {}

  // Keys at or below the floor cannot enter the top k.
  uint64_t floor() const { return floor_; }
  // |c| bits an entry needs to possibly rank above the floor.
  int32_t bound() const { return int32_t(floor_ >> 32); }

  void Add(uint64_t key) {
    if (key > floor_) Insert(key);
  }
  // Inserts a key above the floor, evicting the smallest once k are held.
  void Insert(uint64_t key) {
    if (k_ <= kSortedLimit) {
      InsertSorted(key);
    } else {
      InsertHeap(key);
    }
    if (count_ == k_) floor_ = k_ <= kSortedLimit ? keys_[k_ - 1] : keys_[0];
  }
  // The held keys, best first.
  const uint64_t* Finish() {
    if (k_ > kSortedLimit) {
      std::sort(keys_, keys_ + count_, std::greater<uint64_t>());
    }
    return keys_;
  }

 private:
  // keys_ in descending order.
  void InsertSorted(uint64_t key) {
    int64_t hole = count_ < k_ ? count_++ : k_ - 1;
    for (; hole > 0 && keys_[hole - 1] < key; --hole) {
      keys_[hole] = keys_[hole - 1];
    }
    keys_[hole] = key;
  }
  // keys_ a min-heap.
  void InsertHeap(uint64_t key) {
    if (count_ < k_) {
      int64_t hole = count_++;
      while (hole > 0) {
        const int64_t parent = (hole - 1) / 2;
        if (keys_[parent] <= key) break;
        keys_[hole] = keys_[parent];
        hole = parent;
      }
      keys_[hole] = key;
      return;
    }
    int64_t hole = 0;
    for (int64_t child = 1; child < k_; child = 2 * hole + 1) {
      if (child + 1 < k_ && keys_[child + 1] < keys_[child]) ++child;
      if (keys_[child] >= key) break;
      keys_[hole] = keys_[child];
      hole = child;
    }
    keys_[hole] = key;
  }

  int64_t k_, count_ = 0;
  uint64_t* keys_;
  uint64_t floor_ = 0;  // every rank key is > 0
};

template <typename G>
void StepRow(const Problem& p, MaskFunction<G> masks_of, int64_t row_index,
             Scratch& s) {
  const int64_t m = p.m, k = p.k, r = p.r;
  const int64_t entry = row_index / p.rows;  // batch entry of this row
  const G* row = static_cast<const G*>(p.grads) + row_index * m;
  const float one_minus_mu = p.one_minus_mu[entry], mu = p.mu[entry];
  TopK top(k, s.best.data());
  // The history reads the row at random places before the pass streams it:
  // fetch the next row now so that neither waits for memory.
  if (row_index + 1 < p.batch * p.rows) {
    const char* next = reinterpret_cast<const char*>(row + m);
    for (int64_t byte = 0; byte < m * int64_t(sizeof(G)); byte += 64) {
      __builtin_prefetch(next + byte);
    }
  }

  // The history's k entries first: c = (1 - mu) g + mu * decoded value.
  const float scale = Pow2(p.exponents[row_index]);
  for (int64_t slot = 0; slot < k; ++slot) {
    const int64_t j = HistoryIndex(p, row_index * k + slot);
    if (j < 0 || j >= m) continue;  // never produced; keeps memory safe
    s.slot_of[j] = int32_t(slot);
    const float previous = DecodeE4M3(p.values[row_index * k + slot]) * scale;
    s.merged[slot] = one_minus_mu * Load(row + j) + mu * previous;
    top.Add(RankKey(s.merged[slot], j));
  }

  // One pass over the row; entries under the floor are never looked at.
  bool nonfinite = false;
  const int64_t full_blocks = m / kBlock;
  for (int64_t first = 0; first < full_blocks; first += kChunkBlocks) {
    const int64_t blocks = std::min(kChunkBlocks, full_blocks - first);
    nonfinite |= masks_of(row + first * kBlock, blocks, one_minus_mu,
                          top.bound(), s.masks);
    for (int64_t block = 0; block < blocks; ++block) {
      for (uint32_t mask = s.masks[block]; mask != 0; mask &= mask - 1) {
        const int64_t j = (first + block) * kBlock + __builtin_ctz(mask);
        const uint64_t key = RankKey(one_minus_mu * Load(row + j), j);
        // History positions are in already, merged.
        if (key > top.floor() && s.slot_of[j] < 0) top.Insert(key);
      }
    }
  }
  for (int64_t j = full_blocks * kBlock; j < m; ++j) {
    const float g = Load(row + j);
    nonfinite |= (Bits(g) & kExponentMask) == kExponentMask;
    if (s.slot_of[j] < 0) top.Add(RankKey(one_minus_mu * g, j));
  }
  if (nonfinite) p.nonfinite[entry].store(true, std::memory_order_relaxed);
  // At least k are held: the floor stays 0 until k are.
  const uint64_t* best = top.Finish();
  auto value_at = [&](int32_t j) {
    return s.slot_of[j] >= 0 ? s.merged[s.slot_of[j]]
                             : one_minus_mu * Load(row + j);
  };

  // Encode: the largest |value| goes to [2**7, 2**8) (frexp exponent - 8).
  const uint32_t top_bits = uint32_t(best[0] >> 32);
  const bool special = top_bits == 0 || top_bits >= kExponentMask;
  const int32_t frexp_exponent = special ? 0 : int32_t(top_bits >> 23) - 126;
  const int32_t exponent = std::clamp(frexp_exponent - 8, -126, 119);
  const float inverse_scale = Pow2(-exponent);
  p.new_exponents[row_index] = int8_t(exponent);
  for (int64_t slot = 0; slot < k; ++slot) {
    const int32_t j = RankPosition(best[slot]);
    const float value = value_at(j);
    float scaled = value * inverse_scale;
    scaled = scaled > 448.0f ? 448.0f : (scaled < -448.0f ? -448.0f : scaled);
    const int64_t out = row_index * k + slot;
    p.new_values[out] = EncodeE4M3(scaled);
    if (p.indices_int16) {
      static_cast<int16_t*>(p.new_indices)[out] = int16_t(j);
    } else {
      static_cast<int32_t*>(p.new_indices)[out] = j;
    }
    if (slot < r) {
      p.winner_indices[row_index * r + slot] = j;
      p.winner_signs[row_index * r + slot] =
          value > 0.0f ? 1.0f : (value < 0.0f ? -1.0f : value);
    }
  }
  for (int64_t slot = 0; slot < k; ++slot) {
    const int64_t j = HistoryIndex(p, row_index * k + slot);
    if (j >= 0 && j < m) s.slot_of[j] = -1;
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
  MaskFunction<float> f32_masks = ChooseMasks<float>();
  MaskFunction<uint16_t> bf16_masks = ChooseMasks<uint16_t>();

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
        if (problem.grads_bf16) {
          StepRow(problem, bf16_masks, row, *scratch);
        } else {
          StepRow(problem, f32_masks, row, *scratch);
        }
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
  work->chunk_rows = std::max<int64_t>(1, kChunkElements / p.m);
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
    const int64_t index_offset = b * per_entry * index_bytes;
    std::memcpy(static_cast<char*>(p.new_indices) + index_offset,
                static_cast<const char*>(p.indices) + index_offset,
                per_entry * index_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace taco_kernel

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoColumnStep, taco_kernel::ColumnStep,
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
