// Linear layers for CPU, batch-invariant: y[r, o] = act(bias[o] + sum_i x[r, i] * w[o, i]), x and y float32, the
// weight float32, bfloat16 or float16 (each widened exactly to float32 as it is loaded: half the bytes to stream, the
// same arithmetic); act none or GELU (an encoder's up projection: applied while the panel's sums are in cache).
//
// The weight is held once, in panels of PANEL output columns, [ceil(out / PANEL)][in][PANEL] in its own dtype
// (`panels`: zeros, so the last panel's padding is; `pack_into` writes rows of it from a [rows, in] source, at a row
// offset: the loader fills a stacked q/k/v or gate/up weight tensor by tensor), so that each input index reads PANEL
// consecutive weights: VECS vector loads that every row of a tile multiplies by its broadcast x[r, i]. A single row
// (decode) walks GROUP panels at once instead: more independent chains and weight streams in flight, which a
// memory-bound GEMV needs.
// Each output element is one fused multiply-add chain over i = 0, 1, ..., in - 1 from 0, + bias, act: its rounding
// depends on nothing but its own row and column (not on the other rows, the tile or group a row falls in, the
// thread that runs its panel, nor the ISA: AVX2 and AVX-512 chains are the same IEEE fmas), which is what makes a
// row's logits identical in any batch. Threads split the panels evenly (a memory-bound GEMV is as slow as its
// busiest thread).
//
// Panels, and what huge_copy copies (a benchmark's blocks), lie in huge-page memory (huge.h).
//
// Built twice by gpu/kernels/native/build.py, with -mavx2 -mfma -mf16c (namespace sluice_avx2) and with -mavx512f
// and VNNI (sluice_avx512); gpu/kernels/native/__init__.py loads the one the CPU runs.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "huge.h"
#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using namespace simd;

#if defined(__AVX512F__)
constexpr int TILE = 6, GROUP = 4;  // 32 registers: 24 accumulators in a tile, 16 in a group
#else
constexpr int TILE = 3, GROUP = 2;  // 16 registers: 12 accumulators in a tile, 8 in a group
#endif

constexpr int VECS = 4;
constexpr int64_t PANEL = VECS * LANES;  // output columns per panel: four vectors
constexpr int64_t KBLOCK = 4096 / PANEL;  // inputs per pass over a panel: 16 KB of float32 weights, in L1

at::Tensor huge_copy(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "huge_copy: a CPU tensor");
  return huge_empty(t.sizes(), t.scalar_type()).copy_(t);
}

// f with a weight tensor's elements, typed: float, a bfloat16's bits (uint16_t), or c10::Half.
template <typename T, typename F>
void with_weights(T& t, F&& f) {
  const auto kind = t.scalar_type();
  TORCH_CHECK(kind == at::kFloat || kind == at::kBFloat16 || kind == at::kHalf, "a float32, bfloat16 or float16 weight");
  void* p = const_cast<void*>(t.const_data_ptr());
  if (kind == at::kFloat) return f(static_cast<float*>(p));
  if (kind == at::kBFloat16) return f(static_cast<uint16_t*>(p));
  f(static_cast<c10::Half*>(p));
}

// Where column c of a panel's input row lies: float32 and float16 in order; bfloat16 in pairs of vectors interleaved,
// so that one load of 2 x LANES of them gives vector 2j (the low halves, column 2j * LANES + lane) and 2j + 1 (the
// high).
inline int64_t slot(const float*, int64_t c) { return c; }
inline int64_t slot(const c10::Half*, int64_t c) { return c; }
inline int64_t slot(const uint16_t*, int64_t c) {
  const int64_t pair = c / (2 * LANES), v = c / LANES % 2, lane = c % LANES;
  return pair * 2 * LANES + 2 * lane + v;
}

// The weights of input row i, vector v (LANES columns from v * LANES) of a panel, as float32.
inline Vec wload(const float* row, int v) { return vload(row + v * LANES); }
inline Vec wload(const c10::Half* row, int v) { return vhalf(reinterpret_cast<const uint16_t*>(row) + v * LANES); }
inline Vec wload(const uint16_t* row, int v) {
  return v % 2 ? vhigh16(row + v / 2 * 2 * LANES) : vlow16(row + v / 2 * 2 * LANES);
}

inline float widen(float w) { return w; }
inline float widen(c10::Half w) { return static_cast<float>(w); }
inline float widen(uint16_t w) { return bf16(w); }

at::Tensor panels(int64_t out, int64_t in, at::ScalarType dtype) {
  TORCH_CHECK(out > 0 && in > 0, "panels: a weight of at least one row and column");
  return huge_zeros({(out + PANEL - 1) / PANEL, in, PANEL}, dtype);
}

// Rows offset .. offset + n - 1 of the panels' weight from src [n, in] (W its element type), panel by panel, in
// blocks of STRIP inputs: a cache line of each of the panel's rows in, STRIP whole panel rows (4 KB of float32) out.
template <typename W>
void pack_rows(const W* src, int64_t ld, W* dst, int64_t offset, int64_t n, int64_t in) {
  constexpr int64_t STRIP = 64 / sizeof(W);
  at::parallel_for(offset / PANEL, (offset + n - 1) / PANEL + 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = std::max<int64_t>(0, offset - p * PANEL), c1 = std::min(PANEL, offset + n - p * PANEL);
      for (int64_t i0 = 0; i0 < in; i0 += STRIP)
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t i = i0; i < std::min(in, i0 + STRIP); ++i)
            dst[(p * in + i) * PANEL + slot(dst, c)] = src[(p * PANEL + c - offset) * ld + i];
    }
  });
}

void pack_into(at::Tensor& packed, const at::Tensor& src, int64_t offset) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous(), "pack_into: panels (panels)");
  TORCH_CHECK(src.dim() == 2 && src.size(1) == packed.size(1) && src.stride(1) == 1 && src.size(0) > 0 &&
                  src.scalar_type() == packed.scalar_type(),
              "pack_into: a [rows, in] source of the panels' width and dtype, rows contiguous");
  TORCH_CHECK(0 <= offset && offset + src.size(0) <= packed.size(0) * PANEL, "pack_into: rows past the panels");
  with_weights(packed, [&](auto* dst) {
    using W = std::remove_pointer_t<decltype(dst)>;
    pack_rows(static_cast<const W*>(src.const_data_ptr()), src.stride(0), dst, offset, src.size(0), src.size(1));
  });
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack: an [out, in] weight");
  auto packed = panels(weight.size(0), weight.size(1), weight.scalar_type());
  pack_into(packed, weight.contiguous(), 0);
  return packed;
}

// Rows `ids` of the weight in `src`'s panels, widened to float32 (a tied embedding's lookup: its LM head's panels are
// the table's one copy).
template <typename W>
void gather_rows(const W* src, const int64_t* ids, float* dst, int64_t n, int64_t in) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const W* panel = src + ids[r] / PANEL * in * PANEL;
      const int64_t s = slot(src, ids[r] % PANEL);
      for (int64_t i = 0; i < in; ++i) dst[r * in + i] = widen(panel[i * PANEL + s]);
    }
  });
}

at::Tensor panel_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous() &&
                  (out_features + PANEL - 1) / PANEL == packed.size(0),
              "panel_rows: a packed weight (pack) of out_features rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "panel_rows: int64 ids");
  auto flat = ids.contiguous().view(-1);
  const int64_t n = flat.numel(), in = packed.size(1);
  const int64_t* ip = flat.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(ip, ip + n, [&](int64_t i) { return 0 <= i && i < out_features; }),
              "panel_rows: an id outside 0 .. ", out_features - 1);
  auto rows = at::empty({n, in}, packed.options().dtype(at::kFloat));
  with_weights(packed, [&](auto* w) { gather_rows(w, ip, rows.data_ptr<float>(), n, in); });
  auto shape = ids.sizes().vec();
  shape.push_back(in);
  return rows.view(shape);
}

enum Act : int64_t { NONE = 0, GELU = 1 };  // the activation an output passes through last (GELU: simd::gelu16)

// One row's sums of a panel (PANEL floats at sums, which it overwrites) into y: `cols` valid columns, each plus its
// bias, then the activation.
inline void finish(float* sums, const float* bias, float* y, int64_t cols, int64_t act) {
  if (bias)
    for (int64_t c = 0; c < cols; ++c) sums[c] += bias[c];
  if (act == GELU)
    for (int64_t c = 0; c < PANEL; c += 16) store16(sums + c, gelu16(load16(sums + c)));
  std::copy(sums, sums + cols, y);
}

inline void store(const Vec* acc, const float* bias, float* y, int64_t cols, int64_t act) {
  alignas(64) float buf[PANEL];
  for (int v = 0; v < VECS; ++v) vstore(buf + v * LANES, acc[v]);
  finish(buf, bias, y, cols, act);
}

// R rows of x (row stride ldx) times inputs k0 .. k1 - 1 of one panel: each element's chain continued from its
// partial sum in sums (R x PANEL floats; zeros before the first inputs) and left there. A panel's KBLOCK inputs stay
// in L1 while every row tile of the step passes over them; a float's store and load are exact, so the chain is the
// one a single pass would compute. (Always loaded, and one-dimensional: GCC 12 mirrors a conditionally initialised
// or two-dimensional accumulator array on the stack, a store per accumulator per input, half the kernel's speed.)
template <int R, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1, float* sums) {
  Vec acc[R * VECS];  // (one dimension: GCC 12 mirrors a two-dimensional one on the stack)
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) acc[r * VECS + v] = vload(sums + r * PANEL + v * LANES);
  for (int64_t i = k0; i < k1; ++i) {  // (R x VECS accumulators, R broadcasts and one weight vector: the registers)
    Vec xb[R];
    for (int r = 0; r < R; ++r) xb[r] = vbroadcast(x + r * ldx + i);
    for (int v = 0; v < VECS; ++v) {
      const Vec w = wload(panel + i * PANEL, v);
      for (int r = 0; r < R; ++r) acc[r * VECS + v] = vfma(xb[r], w, acc[r * VECS + v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) vstore(sums + r * PANEL + v * LANES, acc[r * VECS + v]);
}

// One row times GROUP consecutive whole panels (the same chains as a tile's row): y gets GROUP * PANEL columns.
template <typename W>
void row_group(const float* x, const W* panels, int64_t in, const float* bias, float* y, int64_t act) {
  Vec acc[GROUP][VECS];
  for (int g = 0; g < GROUP; ++g)
    for (int v = 0; v < VECS; ++v) acc[g][v] = vzero();
  for (int64_t i = 0; i < in; ++i) {
    const Vec xb = vbroadcast(x + i);
    for (int g = 0; g < GROUP; ++g)
      for (int v = 0; v < VECS; ++v) acc[g][v] = vfma(xb, wload(panels + (g * in + i) * PANEL, v), acc[g][v]);
  }
  for (int g = 0; g < GROUP; ++g) store(acc[g], bias ? bias + g * PANEL : nullptr, y + g * PANEL, PANEL, act);
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*);
template <typename W>  // (up to TILE)
constexpr TileFn<W> TILES[7] = {nullptr, tile<1, W>, tile<2, W>, tile<3, W>, tile<4, W>, tile<5, W>, tile<6, W>};

template <typename W>
void run(const float* xp, int64_t ldx, const W* wp, const float* bp, float* yp, int64_t ldy, int64_t rows, int64_t in,
         int64_t out, int64_t panels, int64_t act) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {  // (an even share of the panels a thread)
    std::vector<float> sums(rows * PANEL);  // (the rows' partial sums of one panel)
    for (int64_t p = begin; p < end;) {
      const int64_t col = p * PANEL;
      if (rows == 1 && p + GROUP <= end && col + GROUP * PANEL <= out) {
        row_group(xp, wp + p * in * PANEL, in, bp ? bp + col : nullptr, yp + col, act);
        p += GROUP;
        continue;
      }
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t k0 = 0; k0 < in; k0 += KBLOCK)
        for (int64_t r = 0; r < rows; r += TILE)
          TILES<W>[std::min<int64_t>(TILE, rows - r)](xp + r * ldx, ldx, wp + p * in * PANEL, k0,
                                                      std::min(in, k0 + KBLOCK), sums.data() + r * PANEL);
      for (int64_t r = 0; r < rows; ++r)
        finish(sums.data() + r * PANEL, bp ? bp + col : nullptr, yp + r * ldy + col, std::min(PANEL, out - col), act);
      ++p;
    }
  });
}

void linear_out(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& y,
                int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "linear: float32 [rows, in] x");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "linear: a packed weight (pack) of x's width");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), count = packed.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == rows && y.stride(1) == 1 && y.scalar_type() == at::kFloat &&
                  (out + PANEL - 1) / PANEL == count,
              "linear: y");
  TORCH_CHECK(!bias || (bias->numel() == out && bias->is_contiguous() && bias->scalar_type() == at::kFloat),
              "linear: float32 bias of out elements");
  TORCH_CHECK(act == NONE || act == GELU, "linear: act 0 (none) or 1 (GELU)");
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  with_weights(packed, [&](auto* w) {
    run(x.data_ptr<float>(), x.stride(0), w, bp, y.data_ptr<float>(), y.stride(0), rows, in, out, count, act);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, int64_t act) {
  auto y = at::empty({x.size(0), out_features}, x.options());
  linear_out(x, packed, bias, y, act);
  return y;
}

}  // namespace

TORCH_LIBRARY(SLUICE_NS, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("huge_copy(Tensor t) -> Tensor");
  m.def("huge_empty(int[] sizes, ScalarType dtype) -> Tensor", &huge_empty);  // (no tensor in: a catch-all kernel)
  m.def("panels(int rows, int cols, ScalarType dtype) -> Tensor", &panels);  // (no tensor in: a catch-all kernel)
  m.def("pack_into(Tensor(a!) packed, Tensor src, int offset) -> ()");
  m.def("panel_rows(Tensor packed, Tensor ids, int out_features) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias, int act=0) -> Tensor");
  m.def("linear_out(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) y, int act=0) -> ()");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("pack", pack);
  m.impl("huge_copy", huge_copy);
  m.impl("pack_into", [](at::Tensor packed, const at::Tensor& src, int64_t offset) { pack_into(packed, src, offset); });
  m.impl("panel_rows", panel_rows);
  m.impl("linear", linear);
  m.impl("linear_out", [](const at::Tensor& x, const at::Tensor& p, const c10::optional<at::Tensor>& b, at::Tensor y,
                          int64_t act) { linear_out(x, p, b, y, act); });
}
