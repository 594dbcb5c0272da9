// Writes one TACO leaf's winners into its float32 or bfloat16 weight, in
// place, as XLA FFI handlers for CPU.
//
// The layer-wise step's write: weight[winner] = weight[winner] + delta, each
// sum rounded once to float32 (built with -ffp-contract=off, as XLA adds a
// materialised update), every other entry untouched; a non-finite gradient
// makes the whole weight NaN, as on the optax path. The output aliases the
// weight (input_output_aliases), so nothing else of it is read or written.
// As a custom call it needs no code generated per weight, where XLA:CPU
// compiles a scatter anew for every weight it writes.
//
// weight: (n, m) when column_axis == 0 (row i of the paper's columns is the
// weight's row i), (m, n) when column_axis == 1 (it is the weight's column
// i); winners and delta: (n, r); finite: a scalar.
//
// The bfloat16 write (TacoWinnerWrite16) adds a float32 delta as the optax
// path's stochastic rounding does (transform/rounding.py): the exact sum is
// rounded to a bfloat16 neighbour, the far one with probability equal to its
// share of the distance, read off 32 hashed bits of the element's flat index
// under the leaf's key; the update that reaches it is rounded to bfloat16 and
// added. With stochastic == 0 the delta is cast to bfloat16 and the sum
// rounded to nearest, as optax.apply_updates adds a bfloat16 update.
// Arithmetic runs with subnormals flushed, as XLA:CPU's does, so the bits are
// the scatter's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "numerics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace taco_kernel {
namespace {

// A bfloat16 from float32, rounded to nearest even (NaN stays a quiet NaN of
// the same sign), as XLA:CPU converts.
inline uint16_t ToBf16(float x) {
  const uint32_t b = Bits(x);
  if ((b & kAbsMask) > kExponentMask) return uint16_t((b >> 16) | 0x40u);
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

inline float FromBf16(uint16_t b) { return FromBits(uint32_t(b) << 16); }

// jnp.nextafter(from, +inf if up else -inf) on bfloat16 bit patterns.
inline uint16_t NextAfterBf16(uint16_t from, bool up) {
  if ((from & 0x7fffu) > 0x7f80u) return 0x7fc0u;  // NaN
  const uint16_t to = up ? 0x7f80u : 0xff80u;
  if (from == to) return to;
  if ((from & 0x7fffu) == 0) return uint16_t((to & 0x8000u) | 1u);
  const bool toward_zero = (from & 0x8000u) != (to & 0x8000u);
  return uint16_t(toward_zero ? from - 1 : from + 1);
}

// MurmurHash3's 32-bit finaliser, as transform/rounding.py's _mix.
inline uint32_t Mix(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// transform.element_bits: 32 random bits of a flat index under a key.
inline uint32_t ElementBits(const uint32_t* key, uint32_t index) {
  return Mix(Mix(index * 0x9e3779b9u + key[0]) ^ key[1]);
}

// transform.rounded_update then the add: the weight's new bfloat16 value.
inline uint16_t RoundedSum(uint16_t current, float delta, bool stochastic,
                           uint32_t bits) {
  const float start = FromBf16(current);
  // Rounded to nearest, the update is cast to bfloat16, then added.
  if (!stochastic) return ToBf16(start + FromBf16(ToBf16(delta)));
  const float target = start + delta;
  const uint16_t nearest = ToBf16(target);
  const float back = FromBf16(nearest);
  uint16_t rounded = nearest;
  if (std::isfinite(target) && back != target) {
    const uint16_t far = NextAfterBf16(nearest, !(back > target));
    const float chance = std::fabs(target - back) /
                         std::fabs(FromBf16(far) - back);
    const float uniform = float(bits >> 8) * (1.0f / 16777216.0f);
    if (uniform < chance) rounded = far;
  }
  const uint16_t update = ToBf16(FromBf16(rounded) - start);
  return ToBf16(start + FromBf16(update));
}

// The geometry both writes share: the weight's columns and entries per
// column (the paper's n and m) and the winners per column.
struct Geometry {
  int64_t columns = 0, entries = 0, r = 0;
};

ffi::Error CheckGeometry(ffi::Span<const int64_t> dims,
                         ffi::Span<const int64_t> winner_dims,
                         size_t delta_count, size_t finite_count,
                         int64_t column_axis, Geometry* g) {
  if (dims.size() != 2 || winner_dims.size() != 2 ||
      delta_count != size_t(winner_dims[0] * winner_dims[1]) ||
      finite_count != 1 || (column_axis != 0 && column_axis != 1)) {
    return ffi::Error::InvalidArgument("taco winner write: bad shapes");
  }
  g->columns = column_axis == 0 ? dims[0] : dims[1];
  g->entries = column_axis == 0 ? dims[1] : dims[0];
  if (winner_dims[0] != g->columns) {
    return ffi::Error::InvalidArgument("taco winner write: winners per column");
  }
  g->r = winner_dims[1];
  return ffi::Error::Success();
}

ffi::Error WinnerWrite16(ffi::Buffer<ffi::BF16> weight,
                         ffi::Buffer<ffi::S32> winners,
                         ffi::Buffer<ffi::F32> delta,
                         ffi::Buffer<ffi::PRED> finite,
                         ffi::Buffer<ffi::U32> key, int64_t column_axis,
                         int64_t stochastic,
                         ffi::ResultBuffer<ffi::BF16> out) {
  Geometry g;
  ffi::Error checked = CheckGeometry(
      weight.dimensions(), winners.dimensions(), delta.element_count(),
      finite.element_count(), column_axis, &g);
  if (checked.failure()) return checked;
  if (key.element_count() != 2) {
    return ffi::Error::InvalidArgument("taco winner write: key of 2 words");
  }
  const uint16_t* in = weight.typed_data();
  uint16_t* o = out->typed_data();
  const size_t count = weight.element_count();
  if (o != in) std::memcpy(o, in, count * sizeof(uint16_t));
  if (!finite.typed_data()[0]) {
    std::fill(o, o + count, uint16_t(0x7fc0u));
    return ffi::Error::Success();
  }
  FlushDenormals flush;
  const int32_t* w = winners.typed_data();
  const float* d = delta.typed_data();
  const uint32_t* k = key.typed_data();
  for (int64_t i = 0; i < g.columns; ++i) {
    for (int64_t s = 0; s < g.r; ++s) {
      const int64_t e = w[i * g.r + s];
      if (e < 0 || e >= g.entries) {
        return ffi::Error::InvalidArgument("taco winner write: winner range");
      }
      const int64_t at =
          column_axis == 0 ? i * g.entries + e : e * g.columns + i;
      // The flat index modulo 2**32, as transform.flat_index forms it.
      o[at] = RoundedSum(o[at], d[i * g.r + s], stochastic != 0,
                         stochastic ? ElementBits(k, uint32_t(at)) : 0u);
    }
  }
  return ffi::Error::Success();
}

ffi::Error WinnerWrite(ffi::Buffer<ffi::F32> weight,
                       ffi::Buffer<ffi::S32> winners,
                       ffi::Buffer<ffi::F32> delta,
                       ffi::Buffer<ffi::PRED> finite, int64_t column_axis,
                       ffi::ResultBuffer<ffi::F32> out) {
  Geometry g;
  ffi::Error checked = CheckGeometry(
      weight.dimensions(), winners.dimensions(), delta.element_count(),
      finite.element_count(), column_axis, &g);
  if (checked.failure()) return checked;
  const int64_t columns = g.columns, entries = g.entries, r = g.r;
  const float* in = weight.typed_data();
  float* o = out->typed_data();
  const size_t count = weight.element_count();
  if (o != in) std::memcpy(o, in, count * sizeof(float));
  if (!finite.typed_data()[0]) {
    std::fill(o, o + count, std::numeric_limits<float>::quiet_NaN());
    return ffi::Error::Success();
  }
  const int32_t* w = winners.typed_data();
  const float* d = delta.typed_data();
  for (int64_t i = 0; i < columns; ++i) {
    for (int64_t s = 0; s < r; ++s) {
      const int64_t e = w[i * r + s];
      if (e < 0 || e >= entries) {
        return ffi::Error::InvalidArgument("taco winner write: winner range");
      }
      const int64_t at = column_axis == 0 ? i * entries + e : e * columns + i;
      o[at] = o[at] + d[i * r + s];
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace taco_kernel

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoWinnerWrite, taco_kernel::WinnerWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("column_axis")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TacoWinnerWrite16, taco_kernel::WinnerWrite16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("column_axis")
                                  .Attr<int64_t>("stochastic")
                                  .Ret<ffi::Buffer<ffi::BF16>>());
