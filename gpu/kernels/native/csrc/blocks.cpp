// Linear layers on GGUF's block formats, held in the file's own bytes: a weight is [out][row bytes], each row its
// blocks in order (the file's layout: nothing repacked, so a weight's values are gguf-py's `dequantize` of them,
// block_values.cpp). One format = one block layout (blocks.h) + its dot product with 8-bit activations, quantized per
// row as llama.cpp quantizes them:
//
// | format | block: elems / bytes, value                                  | activations                              |
// |--------|--------------------------------------------------------------|------------------------------------------|
// | Q4_0   | 32 / 18: d f16, q u4[32]; d (q - 8)                          | Q8_0: d = amax / 127 (kept as f16),      |
// | Q4_1   | 32 / 20: d, m f16, q u4[32]; d q + m                         | q = roundf(x / d), and the sum of q      |
// | Q5_0   | 32 / 22: d f16, fifth bits u32, q u4[32]; d (q - 16)         | (the m's product)                        |
// | Q5_1   | 32 / 24: d, m f16, fifth bits u32, q u4[32]; d q + m         |                                          |
// | Q8_0   | 32 / 34: d f16, q i8[32]; d q                                |                                          |
// | Q4_K   | 256 / 144: d, dmin f16, 6-bit sc, m x 8, q u4[256];          | Q8_K: d = 1 / (-127 / the value of the   |
// |        | d sc q - dmin m                                              | largest |x|), q = nearest(x / d), sums   |
// | Q5_K   | 256 / 176: as Q4_K, with fifth bits u1[256] before the q     | of 16 (the mins' and -32's products)     |
// | Q6_K   | 256 / 210: ql u4, qh u2 [256], sc i8[16], d f16; d sc (q-32) |                                          |
//
// y[r, o] = bias[o] + the sum over blocks of the products' exact integer sums (maddubs/madd, 32 lanes: the same
// 256-bit integer code in both ISA builds) times the block's scales, in float32 lane chains of 8 summed by one tree
// at the end: an element's rounding depends on nothing but its row and column (any batch, thread, tile, ISA: the same
// bits). A NaN or infinite activation makes its block's scale NaN: its row's outputs are NaN (and only its row's).
// Threads split the weight's rows; RT activation rows share each weight block's unpacking, WB weight rows stay in L2
// while the row tiles pass.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "blocks.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

// ---- activations, one row: `in` floats into in / act_elems blocks at out ----

void quantize_q8_0(const float* x, int64_t in, uint8_t* out) {  // (into 40 bytes a block: d, the sum of q, q)
  for (int64_t b = 0; b < in / 32; ++b, x += 32, out += 40) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i])), finite &= std::isfinite(x[i]);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;  // (q rounds half away from 0: roundf)
    const float dh = finite ? static_cast<float>(c10::Half(d)) : NAN;  // (llama.cpp keeps d as f16)
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const auto q = static_cast<int8_t>(finite ? std::round(x[i] * id) : 0);
      out[8 + i] = static_cast<uint8_t>(q), sum += q;
    }
    std::memcpy(out, &dh, 4), std::memcpy(out + 4, &sum, 4);
  }
}

void quantize_q8_k(const float* x, int64_t in, uint8_t* out) {
  for (int64_t b = 0; b < in / 256; ++b, x += 256, out += 292) {
    float amax = 0.0f, max = 0.0f;
    bool finite = true;
    for (int i = 0; i < 256; ++i) {
      finite &= std::isfinite(x[i]);
      if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), max = x[i];
    }
    auto* q = reinterpret_cast<int8_t*>(out + 4);
    const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
    for (int i = 0; i < 256; ++i) q[i] = finite ? static_cast<int8_t>(std::fmin(127.0f, std::nearbyint(iscale * x[i]))) : 0;
    const float d = !finite ? NAN : amax != 0.0f ? 1.0f / iscale : 0.0f;
    std::memcpy(out, &d, 4);
    for (int g = 0; g < 16; ++g) {
      int16_t s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * g + i];
      std::memcpy(out + 260 + 2 * g, &s, 2);
    }
  }
}

// One weight row's blocks against R activation rows: each row's lane accumulators, then its sum into y[r].
// The 32-element formats: each block's 32 values as 8-bit integers (signed: d q; unsigned: d q + m, whose m times the
// activations' sum is a second chain), then one product with the activations' block.
struct Q4_0f {
  static constexpr int64_t bytes = 18;
  static constexpr bool has_min = false;
  static __m256i q(const uint8_t* w) { return _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8)); }
};
struct Q4_1f {
  static constexpr int64_t bytes = 20;
  static constexpr bool has_min = true;
  static __m256i q(const uint8_t* w) { return nibbles(w + 4); }
};
struct Q5_0f {
  static constexpr int64_t bytes = 22;
  static constexpr bool has_min = false;
  static __m256i q(const uint8_t* w) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(w + 6), fifth_bits(w + 2)), _mm256_set1_epi8(16));
  }
};
struct Q5_1f {
  static constexpr int64_t bytes = 24;
  static constexpr bool has_min = true;
  static __m256i q(const uint8_t* w) { return _mm256_or_si256(nibbles(w + 8), fifth_bits(w + 4)); }
};
struct Q8_0f {
  static constexpr int64_t bytes = 34;
  static constexpr bool has_min = false;
  static __m256i q(const uint8_t* w) { return loadu(w + 2); }
};

// One weight row's blocks against R activation rows: each row's lane accumulators, then its sum into y[r].
template <typename F, int R>
void row32(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  __m256 acc[R];
  float mins[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, w += F::bytes) {
    const __m256i q = F::q(w);
    const float d = half(w);
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 40;
      const __m256i p = F::has_min ? dot_u8(q, loadu(ab + 8)) : dot_s8(q, loadu(ab + 8));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * f32(ab)), _mm256_cvtepi32_ps(p), acc[r]);
      if (F::has_min) {
        int32_t sum;
        std::memcpy(&sum, ab + 4, 4);
        mins[r] = std::fma(half(w + 2) * f32(ab), static_cast<float>(sum), mins[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]) + mins[r];
}

template <bool Five, int R>  // (Q4_K; Five: Q5_K, whose fifth bits (bit j of byte l: element 32j + l) precede q)
void q4_k_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  __m256 acc[R];
  float mins[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < blocks; ++b, w += Five ? 176 : 144) {
    __m128i mv;
    const __m256i scales = q4_k_scales(w + 4, mv);
    const float d = half(w), dmin = half(w + 2);
    __m256i q[8], sc[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = loadu(w + (Five ? 48 : 16) + 32 * c);
      q[2 * c] = _mm256_and_si256(bytes, low), q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    }
    if (Five) {
      const __m256i high = loadu(w + 16), one = _mm256_set1_epi8(1);
      for (int j = 0; j < 8; ++j)
        q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, j), one), 4));
    }
    for (int j = 0; j < 8; ++j) sc[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j)));
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 292;
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], loadu(ab + 4 + 32 * j)), sc[j]));
      const float da = f32(ab);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(sum), acc[r]);
      mins[r] = std::fma(dmin * da, static_cast<float>(q4_k_mins(mv, ab)), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]) - mins[r];
}

template <int R>
void q6_k_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
  __m256i pick[4];  // (scale 2k of the lane's 8 in the low lane, 2k + 1 in the high: a shuffle's mask)
  for (int k = 0; k < 4; ++k)
    pick[k] = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>((4 * k + 1) << 8 | 4 * k)),
                                _mm_set1_epi16(static_cast<int16_t>((4 * k + 3) << 8 | (4 * k + 2))));
  for (int64_t b = 0; b < blocks; ++b, w += 210) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
    const float d = half(w + 208);
    __m256i q[8], scales[8];  // q of elements 32j .. 32j + 31 (0..63), and their two groups' scales as int16
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = loadu(w + 64 * h), l1 = loadu(w + 64 * h + 32), hi = loadu(w + 128 + 32 * h);
      const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
      const __m128i half_scales = h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16);
      const __m256i both = _mm256_set_m128i(half_scales, half_scales);  // (groups 8h .. 8h + 7)
      for (int k = 0; k < 4; ++k) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), two);
        q[4 * h + k] = _mm256_or_si256(lows[k], _mm256_slli_epi16(high, 4));
        scales[4 * h + k] = _mm256_shuffle_epi8(both, pick[k]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 292;
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], loadu(ab + 4 + 32 * j)), scales[j]));
      const int offset = hsum_i32(_mm256_madd_epi16(sc16, loadu(ab + 260)));  // (q - 32): 32 x sum of sc x group sums
      const __m256 total = _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * f32(ab)), total, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]);
}

template <int R>
void row_dot(int64_t kind, const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  if (kind == Q4_0) return row32<Q4_0f, R>(w, a, blocks, y);
  if (kind == Q4_1) return row32<Q4_1f, R>(w, a, blocks, y);
  if (kind == Q5_0) return row32<Q5_0f, R>(w, a, blocks, y);
  if (kind == Q5_1) return row32<Q5_1f, R>(w, a, blocks, y);
  if (kind == Q8_0) return row32<Q8_0f, R>(w, a, blocks, y);
  if (kind == Q4_K) return q4_k_row<false, R>(w, a, blocks, y);
  if (kind == Q5_K) return q4_k_row<true, R>(w, a, blocks, y);
  q6_k_row<R>(w, a, blocks, y);
}

// Activation rows a weight row's blocks meet per pass (its scales and unpacked values reused in registers), and
// weight rows per pass over the row tiles. A tile's size changes no result: each (row, column) is its own chain.
#if defined(__AVX512F__)
constexpr int RT = 8;  // (32 vector registers)
#else
constexpr int RT = 4;
#endif
constexpr int64_t WB = 16;
using RowDot = void (*)(int64_t, const uint8_t*, const uint8_t* const*, int64_t, float*);
constexpr RowDot ROWS[9] = {nullptr, row_dot<1>, row_dot<2>, row_dot<3>, row_dot<4>,
                            row_dot<5>, row_dot<6>, row_dot<7>, row_dot<8>};  // (up to RT)

void block_linear_out(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, const c10::optional<at::Tensor>& bias,
                      at::Tensor& y) {
  const Format f = format(kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) % f.elems == 0,
              "block_linear: float32 [rows, in] x, in a multiple of ", f.elems);
  const int64_t rows = x.size(0), in = x.size(1), out = blocks.size(0), nb = in / f.elems;
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == nb * f.bytes,
              "block_linear: uint8 [out, row bytes] blocks of x's width");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == rows && y.size(1) == out && y.stride(1) == 1 && y.scalar_type() == at::kFloat,
              "block_linear: y");
  TORCH_CHECK(!bias || (bias->numel() == out && bias->is_contiguous() && bias->scalar_type() == at::kFloat),
              "block_linear: float32 bias of out elements");
  std::vector<uint8_t> act(rows * nb * f.act_bytes);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint8_t* dst = act.data() + r * nb * f.act_bytes;
      f.act_elems == 32 ? quantize_q8_0(x.data_ptr<float>() + r * x.stride(0), in, dst)
                        : quantize_q8_k(x.data_ptr<float>() + r * x.stride(0), in, dst);
    }
  });
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  at::parallel_for(0, out, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += WB)  // (WB weight rows stay in L2 while the row tiles pass)
      for (int64_t r = 0; r < rows; r += RT) {
        const uint8_t* a[RT];
        float s[RT];
        const int n = static_cast<int>(std::min<int64_t>(RT, rows - r));
        for (int i = 0; i < n; ++i) a[i] = act.data() + (r + i) * nb * f.act_bytes;
        for (int64_t o = o0; o < std::min(end, o0 + WB); ++o) {
          ROWS[n](kind, wp + o * nb * f.bytes, a, nb, s);
          for (int i = 0; i < n; ++i) yp[(r + i) * ldy + o] = bp ? s[i] + bp[o] : s[i];
        }
      }
  });
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, const c10::optional<at::Tensor>& bias) {
  auto y = at::empty({x.size(0), blocks.size(0)}, x.options());
  block_linear_out(x, blocks, kind, bias, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("block_linear(Tensor x, Tensor blocks, int kind, Tensor? bias) -> Tensor");
  m.def("block_linear_out(Tensor x, Tensor blocks, int kind, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("block_linear", block_linear);
  m.impl("block_linear_out", [](const at::Tensor& x, const at::Tensor& b, int64_t kind, const c10::optional<at::Tensor>& bias,
                                at::Tensor y) { block_linear_out(x, b, kind, bias, y); });
}
