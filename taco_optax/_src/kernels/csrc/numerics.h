// Float helpers of TACO's CPU kernel that must match XLA:CPU bit for bit:
// subnormal flushing, the float8_e4m3fn codec and powers of two.

#ifndef TACO_OPTAX_CSRC_NUMERICS_H_
#define TACO_OPTAX_CSRC_NUMERICS_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace taco_kernel {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kExponentMask = 0x7f800000u;

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

}  // namespace taco_kernel

#endif  // TACO_OPTAX_CSRC_NUMERICS_H_
