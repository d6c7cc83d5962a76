// Float32 linear layers for CPU, batch-invariant: y[r, o] = bias[o] + sum_i x[r, i] * w[o, i].
//
// The weight is repacked once (pack) into panels of PANEL output columns, [ceil(out / PANEL)][in][PANEL] (the
// last panel zero-padded), so that each input index reads PANEL consecutive weights: one or two vector loads that
// every row of a tile multiplies by its broadcast x[r, i]. Each output element is one fused multiply-add chain over
// i = 0, 1, ..., in - 1 from 0, then + bias: its rounding depends on nothing but its own row and column (not on the
// other rows, the tile a row falls in, the thread that runs its panel, nor the ISA: AVX2 and AVX-512 chains are the
// same IEEE fmas), which is what makes a row's logits identical in any batch. Threads split the panels.
//
// Built twice by gpu/native/build.py, with -mavx2 -mfma (namespace sluice_avx2) and with -mavx512f (sluice_avx512);
// gpu/native/__init__.py loads the one the CPU runs.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
constexpr int64_t LANES = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

constexpr int64_t PANEL = 2 * LANES;  // output columns per panel: two vectors
constexpr int64_t TILE = 6;  // rows per register tile: 12 accumulators
constexpr int64_t PREFETCH = 16;  // input indices ahead: the panel's weights 2-4 KB ahead (past its end: harmless)

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack: a float32 [out, in] weight");
  auto w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1), panels = (out + PANEL - 1) / PANEL;
  auto packed = at::zeros({panels, in, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < PANEL && p * PANEL + c < out; ++c)
        for (int64_t i = 0; i < in; ++i) dst[(p * in + i) * PANEL + c] = src[(p * PANEL + c) * in + i];
  });
  return packed;
}

// R rows of x (row stride ldx) times one panel: the R x PANEL block of y at y (row stride ldy), `cols` valid.
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, float* y, int64_t ldy,
          int64_t cols) {
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t i = 0; i < in; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (i + PREFETCH) * PANEL), _MM_HINT_T0);
    const Vec w0 = vload(panel + i * PANEL), w1 = vload(panel + i * PANEL + LANES);
    for (int r = 0; r < R; ++r) {
      const Vec xb = vbroadcast(x + r * ldx + i);
      acc[r][0] = vfma(xb, w0, acc[r][0]);
      acc[r][1] = vfma(xb, w1, acc[r][1]);
    }
  }
  alignas(64) float buf[PANEL];
  for (int r = 0; r < R; ++r) {
    vstore(buf, acc[r][0]);
    vstore(buf + LANES, acc[r][1]);
    float* row = y + r * ldy;
    for (int64_t c = 0; c < cols; ++c) row[c] = bias ? buf[c] + bias[c] : buf[c];
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr TileFn TILES[TILE + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

void linear_out(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "linear: float32 [rows, in] x");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) == x.size(1), "linear: packed weight");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), panels = packed.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == rows && y.stride(1) == 1 && (out + PANEL - 1) / PANEL == panels, "linear: y");
  TORCH_CHECK(!bias || (bias->numel() == out && bias->is_contiguous()), "linear: bias of out elements");
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * PANEL, cols = std::min(PANEL, out - col);
      for (int64_t r = 0; r < rows; r += TILE) {
        const int64_t n = std::min(TILE, rows - r);
        TILES[n](xp + r * ldx, ldx, wp + p * in * PANEL, in, bp ? bp + col : nullptr, yp + r * ldy + col, ldy, cols);
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  auto y = at::empty({x.size(0), out_features}, x.options());
  linear_out(x, packed, bias, y);
  return y;
}

}  // namespace

TORCH_LIBRARY(SLUICE_NS, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_out(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("pack", pack);
  m.impl("linear", linear);
  m.impl("linear_out", [](const at::Tensor& x, const at::Tensor& p, const c10::optional<at::Tensor>& b, at::Tensor y) {
    linear_out(x, p, b, y);
  });
}
