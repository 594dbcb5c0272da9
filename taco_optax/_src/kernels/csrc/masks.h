// SIMD screening of gradient rows for TACO's CPU kernel.

#ifndef TACO_OPTAX_CSRC_MASKS_H_
#define TACO_OPTAX_CSRC_MASKS_H_

#include <cstdint>

#include "numerics.h"

namespace taco_kernel {

// Entries are screened in blocks of 16 (one 16-bit mask).
constexpr int64_t kBlock = 16;

// The dense pass screens entries 16 at a time: bit t of a block's mask says
// that |(1 - mu) * g| of entry t has float bits >= the current bound. Masks
// are made with SIMD, a chunk of blocks per call; each function also reports
// whether some g in the chunk is NaN or infinite.
template <typename G>
using MaskFunction = bool (*)(const G* row, int64_t blocks, float one_minus_mu,
                              int32_t bound, uint16_t* masks);

template <typename G>
bool MasksPortable(const G* row, int64_t blocks, float one_minus_mu,
                   int32_t bound, uint16_t* masks) {
  uint32_t nonfinite = 0;
  for (int64_t block = 0; block < blocks; ++block) {
    uint32_t mask = 0;
    for (int64_t t = 0; t < kBlock; ++t) {
      const float g = Load(row + block * kBlock + t);
      nonfinite |= uint32_t((Bits(g) & kExponentMask) == kExponentMask);
      const int32_t key = int32_t(Bits(one_minus_mu * g) & kAbsMask);
      mask |= uint32_t(key >= bound) << t;
    }
    masks[block] = uint16_t(mask);
  }
  return nonfinite != 0;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) inline __m256 LoadAvx2(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2"))) inline __m256 LoadAvx2(const uint16_t* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

template <typename G>
__attribute__((target("avx2"))) bool MasksAvx2(
    const G* row, int64_t blocks, float one_minus_mu, int32_t bound,
    uint16_t* masks) {
  const __m256 scale = _mm256_set1_ps(one_minus_mu);
  const __m256i abs_mask = _mm256_set1_epi32(int32_t(kAbsMask));
  const __m256i exponent_mask = _mm256_set1_epi32(int32_t(kExponentMask));
  const __m256i below = _mm256_set1_epi32(bound - 1);
  __m256i nonfinite = _mm256_setzero_si256();
  for (int64_t block = 0; block < blocks; ++block) {
    uint32_t mask = 0;
    for (int half = 0; half < 2; ++half) {
      const __m256 g = LoadAvx2(row + block * kBlock + half * 8);
      const __m256i bits = _mm256_castps_si256(g);
      nonfinite = _mm256_or_si256(nonfinite, _mm256_cmpeq_epi32(
          _mm256_and_si256(bits, exponent_mask), exponent_mask));
      const __m256i key = _mm256_and_si256(
          _mm256_castps_si256(_mm256_mul_ps(g, scale)), abs_mask);
      const int hits = _mm256_movemask_ps(
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(key, below)));
      mask |= uint32_t(hits) << (8 * half);
    }
    masks[block] = uint16_t(mask);
  }
  return _mm256_movemask_epi8(nonfinite) != 0;
}
#endif

// The widest mask function this CPU runs (chosen at run time, so the cached
// library stays portable across machines sharing it).
template <typename G>
MaskFunction<G> ChooseMasks() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return MasksAvx2<G>;
#endif
  // Baseline: plain C++, which -O3 vectorises for the baseline ISA (SSE2).
  return MasksPortable<G>;
}

}  // namespace taco_kernel

#endif  // TACO_OPTAX_CSRC_MASKS_H_
