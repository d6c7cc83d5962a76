// Quantized linear layers for CPU (`--quantization`, gpu/layers/quant.py), llama.cpp's Q4 / Q8 x Q8 schemes: activations
// quantized per row and group of 32 inputs on the fly, x ~ d a with d = max|x| / 127 and a = round(x / d) in
// -127..127; products summed exactly in integers (maddubs: u8 x s8 pairs to int16, then pairs to int32), the
// scales applied in float32.
// - int4: w = (q - 8) s + z, q in 0..15, s and z bfloat16 per (column, group); a group's dot product is
//   d (s sum(q a) + m sum(a)) with m = z - 8 s. qweight [out, pairs x 32] bytes, pairs = ceil(groups / 2): byte j of
//   pair p of a column = q[2p][j] | q[2p + 1][j] << 4 (one 256-bit load, a mask and a shift give both groups' 32
//   q's); scales [out, 2, groups] float32: s, then m (both exact from the bfloat16s: m rounds once, as it would here).
//   The m terms are a row's dot product with the column's m's, eight groups a vector.
// - int8: w = q s, q in -127..127, s bfloat16 per column; y = s (the sum over groups of d sum(q a)). qweight
//   [out, in] int8 (torch's layout), scales [out] bfloat16.
// The same 256-bit code in both ISAs' builds, each column's float sums in one fixed order (even and odd groups' in
// turn, eight lanes each, then their sum and one tree; int4's m terms in eight lanes and a tree, added last), each
// row quantized alone: a row's result is the same bits in any batch and on either build. Threads split the columns
// evenly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using simd::bf16;

constexpr int64_t QG = 32;  // inputs per group
constexpr int64_t RT = 4;  // rows per pass over a column's weights

inline float hsum8(__m256 v) {  // lanes i + i+4, then i + i+2, then i + i+1
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// One row's groups quantized: a (int8, in), d[g] (the scale), c[g] = d sum(a) of the group. x / d in double (no
// overflow for the tiniest groups); a group holding a NaN or an infinity gets a = 0 and d = NaN: its row's outputs NaN.
void quantize_row(const float* x, int64_t in, int8_t* a, float* d, float* c) {
  for (int64_t g = 0; g < in / QG; ++g) {
    const float* xg = x + g * QG;
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < QG; ++i) amax = std::max(amax, std::fabs(xg[i])), finite &= std::isfinite(xg[i]);
    const double inv = finite && amax > 0.0f ? 127.0 / amax : 0.0;
    int32_t sum = 0;
    for (int64_t i = 0; i < QG; ++i) {
      const double scaled = std::max(-127.0, std::min(127.0, std::nearbyint(xg[i] * inv)));
      const int32_t q = finite ? static_cast<int32_t>(scaled) : 0;
      a[g * QG + i] = static_cast<int8_t>(q), sum += q;
    }
    const float scale = finite ? amax / 127.0f : NAN;
    d[g] = scale, c[g] = scale * static_cast<float>(sum);
  }
}

// The dot of n floats at a and b (a column's m's, a row's c's): eight lanes, the tail masked, one tree.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  if (i < n) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - i)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
  }
  return hsum8(acc);
}

// Group g's 32 q's of one column (q) into R rows' accumulators: s_g d_rg sum(q a_rg), in float.
template <int R>
inline void group(__m256i q, float s, int64_t g, int64_t groups, const int8_t* a, const float* d, __m256* acc) {
  for (int r = 0; r < R; ++r) {
    const __m256i ar = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * groups * QG + g * QG));
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(q, ar), _mm256_set1_epi16(1));  // (<= 3810: exact)
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(s * d[r * groups + g]), acc[r]);
  }
}

// R rows (quantized: a, d, c, each row `in` / `groups` apart) times column o: y[r * ldy] = the dot + bias. Even and
// odd groups (a pair's low and high nibbles) go to two accumulators a row (two fma chains; explicit, so that they
// stay in registers); then the m terms.
template <int R>
void column(const uint8_t* w, const float* sm, int64_t groups, const int8_t* a, const float* d, const float* c,
            float bias, float* y, int64_t ldy) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 2) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16));
    group<R>(_mm256_and_si256(b, low), sm[g], g, groups, a, d, even);
    if (g + 1 < groups) group<R>(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), sm[g + 1], g + 1, groups, a, d, odd);
  }
  for (int r = 0; r < R; ++r)
    y[r * ldy] = (hsum8(_mm256_add_ps(even[r], odd[r])) + dot(sm + groups, c + r * groups, groups)) + bias;
}

using ColumnFn = decltype(&column<1>);
constexpr ColumnFn COLUMNS[RT + 1] = {nullptr, column<1>, column<2>, column<3>, column<4>};

// What both ops share: x's rows quantized, y made, the columns split evenly over the threads and each column's rows
// passed in tiles of up to RT: call(o, tile, a, d, c, bias, y, ldy) computes column o of `tile` rows.
template <class Call>
at::Tensor quantized_linear(const char* op, const at::Tensor& x, int64_t out, const c10::optional<at::Tensor>& bias,
                            Call call) {
  const int64_t rows = x.size(0), in = x.size(1), groups = in / QG;
  TORCH_CHECK(!bias || (bias->numel() == out && bias->scalar_type() == at::kFloat && bias->is_contiguous()), op,
              ": float32 bias of out elements");
  std::vector<int8_t> a(rows * in);
  std::vector<float> d(rows * groups), c(rows * groups);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) quantize_row(xp + r * in, in, &a[r * in], &d[r * groups], &c[r * groups]);
  auto y = at::empty({rows, out}, x.options());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t r = 0; r < rows; r += RT)
        call(o, std::min(RT, rows - r), &a[r * in], &d[r * groups], &c[r * groups], bp ? bp[o] : 0.0f,
             yp + r * out + o, out);
  });
  return y;
}

inline void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QG == 0, op,
              ": contiguous float32 x [rows, in], in a multiple of 32");
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  check_x("int4_linear", x);
  const int64_t in = x.size(1), out = qweight.size(0), groups = in / QG;
  const int64_t width = (groups + 1) / 2 * 32;  // a column's bytes: pairs of groups
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == width && qweight.scalar_type() == at::kByte &&
                  qweight.is_contiguous(), "int4_linear: uint8 qweight [out, ceil(in / 64) x 32]");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == out && scales.size(1) == 2 && scales.size(2) == groups &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int4_linear: float32 scales [out, 2, in / 32]");
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  return quantized_linear("int4_linear", x, out, bias,
                          [&](int64_t o, int64_t tile, const int8_t* a, const float* d, const float* c, float b,
                              float* y, int64_t ldy) {
                            COLUMNS[tile](wp + o * width, sp + o * groups * 2, groups, a, d, c, b, y, ldy);
                          });
}

// int8 (per column) weights: R rows times column o, y = s * (the sum over groups of d_g sum(q a)) + bias: |q| a's
// sign-adjusted pairs in int16 (<= 2 x 127 x 127: exact), then as int4's: even and odd groups in two chains.
template <int R>
void column8(const int8_t* w, float s, int64_t groups, const int8_t* a, const float* d, float bias, float* y,
             int64_t ldy) {
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  auto step = [&](int64_t g, __m256* into) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * QG));
    const __m256i mag = _mm256_sign_epi8(q, q);
    for (int r = 0; r < R; ++r) {
      const __m256i ar = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * groups * QG + g * QG));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(ar, q)), ones);
      into[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[r * groups + g]), into[r]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) step(g, acc[0]), step(g + 1, acc[1]);
  if (g < groups) step(g, acc[0]);
  for (int r = 0; r < R; ++r) y[r * ldy] = s * hsum8(_mm256_add_ps(acc[0][r], acc[1][r])) + bias;
}

using Column8Fn = decltype(&column8<1>);
constexpr Column8Fn COLUMNS8[RT + 1] = {nullptr, column8<1>, column8<2>, column8<3>, column8<4>};

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  check_x("int8_linear", x);
  const int64_t in = x.size(1), out = qweight.size(0), groups = in / QG;
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == in && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous(), "int8_linear: int8 qweight [out, in]");
  TORCH_CHECK(scales.numel() == out && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
              "int8_linear: bf16 scales [out]");
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  return quantized_linear("int8_linear", x, out, bias,
                          [&](int64_t o, int64_t tile, const int8_t* a, const float* d, const float*, float b, float* y,
                              int64_t ldy) { COLUMNS8[tile](wp + o * in, bf16(sp[o]), groups, a, d, b, y, ldy); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear", int8_linear);
}
