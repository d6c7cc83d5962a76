// Bidirectional attention for CPU encoders (gpu/models/bert.py), float32, batch-invariant: a step's inputs come
// packed, input i's tokens one after another (lens[i] of them), and each token attends over every key of its own
// input, nothing else (no padding, no mask).
//
// q, k, v [T, H * D] (row strides their own: a projection's output or a view of a stacked one), out [T, H * D]
// (contiguous: what the output projection reads, with no transpose between). For query i and key j of an input, the
// score s_ij = (q_i . k_j) x scale, + bias[h, j - i + L - 1] where a per-offset bias [H, 2L - 1] is given (MPNet's
// relative positions; L at least the longest input); then an exact softmax over the row (its max, e^(s - max) by
// simd::exp16, their sum by V16 lanes over the row's keys and simd::sum16's tree), the values summed in key order,
// times 1 / the sum.
//
// One task per head and input, head-major (two threads split the heads, not inputs of unequal cost): the head's keys
// packed transposed, [D][n rounded up to KEYS] (zeros past n), then blocks of QR queries against KEYS keys at a time
// in QR x KC accumulators (registers), scaled, biased and their row's max taken as they are stored; the values
// summed for several rows at once. Each score is one fma chain over d = 0 .. D - 1 from 0, each output lane one over
// j = 0 .. n - 1: a token's result depends on nothing but its own input's q, k and v (not the batch around it, the
// block its row falls in, the thread count, nor the ISA), so an input's embedding is the same bits alone or in any
// batch. A NaN score makes its row NaN, as torch's softmax does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <utility>
#include <vector>

#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using namespace simd;

#if defined(__AVX512F__)
constexpr int QR = 8, ACC = 16;  // queries per block: QR x KC V16 accumulators (16 of 32 registers); the values' budget
#else
constexpr int QR = 2, ACC = 4;  // (8 of 16 registers: a V16 is two)
#endif
constexpr int KC = 2;  // V16s of keys per block
constexpr int64_t KEYS = KC * 16;
constexpr int MAX_DV = 16;  // D / 16 rounded up: head dims up to 256

// One input's head: its rows' first floats and strides, and the bias row of the head (null: none).
struct Head {
  const float *q, *k, *v;
  int64_t q_stride, k_stride, v_stride, n, dim;
  float* out;
  int64_t out_stride;
  float scale;
  const float* bias;  // bias[j - i + center]
  int64_t center;
};

// Query i's scores (s [np]: q . k x scale + bias, -inf past n) become its softmax's numerators, 0 past n, given their
// max m; returns 1 / their sum.
inline float softmax(int64_t n, float* s, V16 m) {
  const V16 shift = set16(-max16(m));
  V16 l = zero16();
  for (int64_t j = 0; j < n; j += 16) {
    const V16 p = first16(exp16(add16(load16(s + j), shift)), static_cast<int>(n - j), 0.0f);  // (exp16 has a floor)
    store16(s + j, p);
    l = add16(l, p);
  }
  return 1.0f / sum16(l);
}

// Rows i .. i + rows - 1's outputs from their numerators p [PR][np] and inv: PR rows at once (each value row loaded
// once for them), DV V16s each.
template <int DV, int PR>
void values(const Head& a, int64_t i, int64_t rows, const float* p, int64_t np, const float* inv) {
  V16 acc[PR * DV];  // (one dimension: GCC 12 mirrors a two-dimensional one on the stack, as linear.cpp says)
  for (auto& x : acc) x = zero16();
  for (int64_t j = 0; j < a.n; ++j) {
    const float* row = a.v + j * a.v_stride;
    V16 vj[DV];
    for (int v = 0; v < DV; ++v) vj[v] = lanes(row, v * 16, a.dim);
    for (int r = 0; r < PR; ++r) {
      const V16 pj = set16(p[r * np + j]);
      for (int v = 0; v < DV; ++v) acc[r * DV + v] = fma16(pj, vj[v], acc[r * DV + v]);
    }
  }
  alignas(64) float buf[PR][DV * 16];  // (every row stored, by constant indices: a register's index a run-time row
  for (int r = 0; r < PR; ++r)       // would keep the accumulators mirrored on the stack, a store each key)
    for (int v = 0; v < DV; ++v) store16(buf[r] + v * 16, mul16(acc[r * DV + v], set16(inv[r])));
  for (int64_t r = 0; r < rows; ++r) std::copy(buf[r], buf[r] + a.dim, a.out + (i + r) * a.out_stride);
}

// Rows of the values' tile: QR, halved until their accumulators fit in registers (ACC V16s).
constexpr int values_rows(int dv) {
  int rows = QR;
  while (rows > 1 && dv * rows > ACC) rows /= 2;
  return rows;
}

// One input's head, kt and scores: the task's scratch (reused by the thread's next task).
template <int DV>
void attend_head(const Head& a, std::vector<float>& kt, std::vector<float>& scores) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t n = a.n, dim = a.dim, np = (n + KEYS - 1) / KEYS * KEYS;
  kt.assign(dim * np, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < dim; ++d) kt[d * np + j] = a.k[j * a.k_stride + d];
  scores.resize(QR * np);
  for (int64_t i0 = 0; i0 < n; i0 += QR) {
    const float* q[QR];  // (a last block's missing rows repeat its last row: computed, not used)
    for (int r = 0; r < QR; ++r) q[r] = a.q + std::min(i0 + r, n - 1) * a.q_stride;
    V16 m[QR];  // (each row's running max)
    for (auto& x : m) x = set16(NEG_INF);
    for (int64_t j0 = 0; j0 < np; j0 += KEYS) {
      V16 acc[QR * KC];
      for (auto& x : acc) x = zero16();
      for (int64_t d = 0; d < dim; ++d) {
        V16 k[KC];
        for (int c = 0; c < KC; ++c) k[c] = load16(kt.data() + d * np + j0 + c * 16);
        for (int r = 0; r < QR; ++r) {
          const V16 qd = set16(q[r][d]);
          for (int c = 0; c < KC; ++c) acc[r * KC + c] = fma16(qd, k[c], acc[r * KC + c]);
        }
      }
      for (int r = 0; r < QR; ++r) {
        const int64_t i = std::min(i0 + r, n - 1);
        for (int c = 0; c < KC; ++c) {
          const int64_t j = j0 + c * 16;
          const int valid = static_cast<int>(std::clamp<int64_t>(n - j, 0, 16));
          V16 x = mul16(acc[r * KC + c], set16(a.scale));
          if (a.bias != nullptr && valid > 0) {  // (offsets j - i .. j - i + 15 of the bias, read while the key < n)
            const float* b = a.bias + a.center - i + j;
            x = add16(x, valid == 16 ? load16(b) : load16(b, valid));
          }
          x = first16(x, valid, NEG_INF);
          store16(scores.data() + r * np + j, x);
          m[r] = max16(m[r], x);
        }
      }
    }
    constexpr int PR = values_rows(DV);
    const int64_t rows = std::min<int64_t>(QR, n - i0);
    float inv[QR] = {};
    for (int64_t r = 0; r < rows; ++r) inv[r] = softmax(n, scores.data() + r * np, m[r]);
    for (int64_t r = 0; r < rows; r += PR)
      values<DV, PR>(a, i0 + r, std::min<int64_t>(PR, rows - r), scores.data() + r * np, np, inv + r);
  }
}

using AttendFn = decltype(&attend_head<1>);
template <int... DV>
constexpr std::array<AttendFn, sizeof...(DV)> table_of(std::integer_sequence<int, DV...>) {
  return {attend_head<DV + 1>...};
}
constexpr auto ATTEND = table_of(std::make_integer_sequence<int, MAX_DV>());  // [DV - 1]

at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lens,
                             int64_t heads, double scale, const c10::optional<at::Tensor>& bias) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->stride(1) == 1 && t->sizes() == q.sizes(),
                "encoder_attention: q, k and v float32 [T, H * D], rows of unit stride");
  const int64_t tokens = q.size(0), width = q.size(1), dim = heads > 0 ? width / heads : 0;
  TORCH_CHECK(heads > 0 && dim > 0 && dim * heads == width && dim <= MAX_DV * 16,
              "encoder_attention: H * D columns, 0 < D <= 256");
  int64_t total = 0, longest = 0;
  for (const int64_t n : lens) {
    TORCH_CHECK(n > 0, "encoder_attention: an empty input");
    total += n, longest = std::max(longest, n);
  }
  TORCH_CHECK(total == tokens, "encoder_attention: lens sum to q's tokens");
  const float* bp = nullptr;
  int64_t center = 0;
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == at::kFloat && b.is_contiguous() && b.size(0) == heads &&
                    b.size(1) % 2 == 1 && (b.size(1) + 1) / 2 >= longest,
                "encoder_attention: a contiguous float32 bias [H, 2L - 1], L at least the longest input");
    bp = b.data_ptr<float>(), center = (b.size(1) - 1) / 2;
  }
  std::vector<int64_t> starts(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) starts[i + 1] = starts[i] + lens[i];
  auto out = at::empty({tokens, width}, q.options());
  const AttendFn attend = ATTEND[(dim + 15) / 16 - 1];
  const int64_t inputs = static_cast<int64_t>(lens.size());
  at::parallel_for(0, heads * inputs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / inputs, i = task % inputs, t = starts[i], col = h * dim;
      const Head a{q.data_ptr<float>() + t * q.stride(0) + col, k.data_ptr<float>() + t * k.stride(0) + col,
                   v.data_ptr<float>() + t * v.stride(0) + col, q.stride(0), k.stride(0), v.stride(0), lens[i], dim,
                   out.data_ptr<float>() + t * width + col, width, static_cast<float>(scale),
                   bp == nullptr ? nullptr : bp + h * (2 * center + 1), center};
      attend(a, kt, scores);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, int[] lens, int heads, float scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) { m.impl("encoder_attention", encoder_attention); }
