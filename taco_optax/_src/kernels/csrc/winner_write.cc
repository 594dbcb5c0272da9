// Writes one TACO leaf's winners into its float32 weight, in place, as an XLA
// FFI handler for CPU.
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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace taco_kernel {
namespace {

ffi::Error WinnerWrite(ffi::Buffer<ffi::F32> weight,
                       ffi::Buffer<ffi::S32> winners,
                       ffi::Buffer<ffi::F32> delta,
                       ffi::Buffer<ffi::PRED> finite, int64_t column_axis,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = weight.dimensions();
  const auto winner_dims = winners.dimensions();
  if (dims.size() != 2 || winner_dims.size() != 2 ||
      delta.element_count() != winners.element_count() ||
      finite.element_count() != 1 || (column_axis != 0 && column_axis != 1)) {
    return ffi::Error::InvalidArgument("taco winner write: bad shapes");
  }
  const int64_t columns = column_axis == 0 ? dims[0] : dims[1];
  const int64_t entries = column_axis == 0 ? dims[1] : dims[0];
  if (winner_dims[0] != columns) {
    return ffi::Error::InvalidArgument("taco winner write: winners per column");
  }
  const int64_t r = winner_dims[1];
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
