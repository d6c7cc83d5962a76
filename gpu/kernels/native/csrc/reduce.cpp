// Row sums for CPU, float32, batch-invariant: y[r] = the sum of x[r, :], each row by one fixed order (sixteen lanes,
// lane l summing x[r, 16 k + l] for k = 0, 1, ... in turn, then simd::sum16's tree over the lanes), whatever the
// other rows, the thread that runs it or the ISA. Rows are split over the threads; a row is never split (torch splits
// a single long row's sum over the threads, and several rows' not: a row's last bits then depend on the batch).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using namespace simd;

at::Tensor row_sum(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "row_sum: float32 [rows, n] x");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto y = at::empty({rows, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * ld;
      V16 acc = zero16();
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) acc = add16(acc, load16(row + i));
      if (i < n) acc = add16(acc, load16(row + i, static_cast<int>(n - i)));
      yp[r] = sum16(acc);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) { m.def("row_sum(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) { m.impl("row_sum", row_sum); }
