// Linear layers on GGUF's block formats, held in the file's own bytes: a weight is [out][row bytes], each row its
// blocks in order (the file's layout: nothing repacked, so a weight's values are gguf-py's `dequantize` of them).
// One format = one block layout + its dot product with 8-bit activations, as llama.cpp quantizes them:
//
// | format | block (elems / bytes)                              | activations (per row)                          |
// |--------|----------------------------------------------------|------------------------------------------------|
// | Q8_0   | d f16, q i8[32]: d * q (32 / 34)                   | Q8_0: d = amax / 127 (f16), q = round(x / d)   |
// | Q4_K   | d, dmin f16, 6-bit sc/m x 8, q u4[256]: d sc q - dmin m (256 / 144) | Q8_K: d = max / -127 (f32, the sign |
// | Q6_K   | ql u4[256], qh u2[256], sc i8[16], d f16: d sc (q - 32) (256 / 210) | of the largest |x|), q, sums of 16 |
//
// y[r, o] = bias[o] + sum over blocks b of the products' exact integer sums (maddubs/madd, 32 lanes: the same
// 256-bit integer code in both ISA builds) times the block's scales, in float32 lane chains of 8 summed by one tree
// at the end: an element's rounding depends on nothing but its row and column (any batch, thread, ISA: the same
// bits). A NaN or infinite activation makes its block's scale NaN: its row's outputs are NaN (and only its row's).
// Threads split the weight's rows; R = 4 activation rows share each block load (the row stays in L1 between tiles).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

enum Kind : int64_t { Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // ggml's type ids (gguf.GGMLQuantizationType)

struct Format {
  int64_t elems, bytes;  // a weight block's
  int64_t act_elems, act_bytes;  // an activation block's
};

Format format(int64_t kind) {
  switch (kind) {
    case Q8_0: return {32, 34, 32, 36};  // (activations: f32 d widened from its f16, 32 q)
    case Q4_K: return {256, 144, 256, 292};  // (Q8_K: f32 d, 256 q, 16 int16 sums)
    case Q6_K: return {256, 210, 256, 292};
    default: TORCH_CHECK(false, "block format ", kind, " has no kernel (Q8_0, Q4_K and Q6_K do)");
  }
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline float f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// ---- activations, one row: `in` floats into in / act_elems blocks at out ----

void quantize_q8_0(const float* x, int64_t in, uint8_t* out) {
  for (int64_t b = 0; b < in / 32; ++b, x += 32, out += 36) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i])), finite &= std::isfinite(x[i]);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;  // (q rounds half away from 0: roundf)
    const float dh = finite ? static_cast<float>(c10::Half(d)) : NAN;  // (llama.cpp keeps d as f16)
    std::memcpy(out, &dh, 4);
    for (int i = 0; i < 32; ++i) out[4 + i] = static_cast<uint8_t>(static_cast<int8_t>(finite ? std::round(x[i] * id) : 0));
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

// ---- integer products: 32 u8 x 32 i8 -> 8 int32 lanes (exact: every pair sum fits maddubs' int16) ----

inline __m256i loadu(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i dot_u8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
inline __m256i dot_s8(__m256i w, __m256i a) { return dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)); }

inline float hsum(__m256 v) {  // ((0+4) + (2+6)) + ((1+5) + (3+7)): one tree
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// One weight row's blocks against R activation rows: each row's lane accumulators, then its sum into y[r].
template <int R>
void q8_0_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, w += 34) {
    const __m256i q = loadu(w + 2);
    const float d = half(w);
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 36;
      const __m256 p = _mm256_cvtepi32_ps(dot_s8(q, loadu(ab + 4)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * f32(ab)), p, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]);
}

// Q4_K's 6-bit scale and min of sub-block j (gguf-py's Q4_K.get_scale_min)
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline int bsum(const uint8_t* ab, int g) {
  int16_t s;
  std::memcpy(&s, ab + 260 + 2 * g, 2);
  return s;
}

template <int R>
void q4_k_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  __m256 acc[R];
  float mins[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < blocks; ++b, w += 144) {
    int sc[8], m[8];
    for (int j = 0; j < 8; ++j) scale_min(w + 4, j, sc[j], m[j]);
    const float d = half(w), dmin = half(w + 2);
    __m256i q[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = loadu(w + 16 + 32 * c);
      q[2 * c] = _mm256_and_si256(bytes, low), q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 292;
      __m256i sum = _mm256_setzero_si256();
      int msum = 0;
      for (int j = 0; j < 8; ++j) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], loadu(ab + 4 + 32 * j)), _mm256_set1_epi16(sc[j]));
        sum = _mm256_add_epi32(sum, p);
        msum += m[j] * (bsum(ab, 2 * j) + bsum(ab, 2 * j + 1));
      }
      const float da = f32(ab);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * da), _mm256_cvtepi32_ps(sum), acc[r]);
      mins[r] = std::fma(dmin * da, static_cast<float>(msum), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]) - mins[r];
}

template <int R>
void q6_k_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < blocks; ++b, w += 210) {
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = half(w + 208);
    __m256i q[8], scales[8];  // q of elements 32k .. 32k + 31 (0..63), and their two scales (16 each) as int16
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = loadu(w + 64 * h), l1 = loadu(w + 64 * h + 32), hi = loadu(w + 128 + 32 * h);
      const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
      for (int k = 0; k < 4; ++k) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), two);
        q[4 * h + k] = _mm256_or_si256(lows[k], _mm256_slli_epi16(high, 4));
        const int g = 8 * h + 2 * k;
        scales[4 * h + k] = _mm256_setr_m128i(_mm_set1_epi16(sc[g]), _mm_set1_epi16(sc[g + 1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 292;
      __m256i sum = _mm256_setzero_si256();
      int offset = 0;  // (q - 32): 32 x sum over groups of sc x the group's activation sum
      for (int j = 0; j < 8; ++j)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], loadu(ab + 4 + 32 * j)), scales[j]));
      for (int g = 0; g < 16; ++g) offset += sc[g] * bsum(ab, g);
      const __m256 total = _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * f32(ab)), total, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]);
}

template <int R>
void row_dot(int64_t kind, const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  if (kind == Q8_0) return q8_0_row<R>(w, a, blocks, y);
  if (kind == Q4_K) return q4_k_row<R>(w, a, blocks, y);
  q6_k_row<R>(w, a, blocks, y);
}

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
      kind == Q8_0 ? quantize_q8_0(x.data_ptr<float>() + r * x.stride(0), in, dst)
                   : quantize_q8_k(x.data_ptr<float>() + r * x.stride(0), in, dst);
    }
  });
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  at::parallel_for(0, out, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* w = wp + o * nb * f.bytes;
      for (int64_t r = 0; r < rows; r += 4) {
        const uint8_t* a[4];
        float s[4];
        const int n = static_cast<int>(std::min<int64_t>(4, rows - r));
        for (int i = 0; i < n; ++i) a[i] = act.data() + (r + i) * nb * f.act_bytes;
        if (n == 4) row_dot<4>(kind, w, a, nb, s); else if (n == 3) row_dot<3>(kind, w, a, nb, s);
        else if (n == 2) row_dot<2>(kind, w, a, nb, s); else row_dot<1>(kind, w, a, nb, s);
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

// ---- values: rows `ids` of the weight dequantized to float32, as gguf-py's `dequantize` computes them ----

void dequantize_row(int64_t kind, const uint8_t* w, int64_t blocks, float* y) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (kind == Q8_0) {
      const float d = half(w);
      for (int i = 0; i < 32; ++i) *y++ = static_cast<float>(static_cast<int8_t>(w[2 + i])) * d;
      w += 34;
    } else if (kind == Q4_K) {
      const float d = half(w), dmin = half(w + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min(w + 4, j, sc, m);
        const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = w[16 + 32 * (j / 2) + i];
          *y++ = ds * static_cast<float>(j % 2 ? byte >> 4 : byte & 0xF) - dm;
        }
      }
      w += 144;
    } else {
      const float d = half(w + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, k = i / 32, l = i % 32;
        const uint8_t lo = w[64 * h + l + 32 * (k % 2)];
        const int q = ((k < 2 ? lo & 0xF : lo >> 4) | (((w[128 + 32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
        *y++ = (d * static_cast<float>(static_cast<int8_t>(w[192 + e / 16]))) * static_cast<float>(q);
      }
      w += 210;
    }
  }
}

at::Tensor block_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t kind, int64_t in_features) {
  const Format f = format(kind);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  in_features % f.elems == 0 && blocks.size(1) == in_features / f.elems * f.bytes,
              "block_rows: uint8 [out, row bytes] blocks of in_features columns");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "block_rows: int64 ids");
  auto flat = ids.contiguous().view(-1);
  const int64_t n = flat.numel(), out = blocks.size(0);
  const int64_t* ip = flat.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(ip, ip + n, [&](int64_t i) { return 0 <= i && i < out; }), "block_rows: an id outside 0 .. ", out - 1);
  auto rows = at::empty({n, in_features}, blocks.options().dtype(at::kFloat));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      dequantize_row(kind, blocks.data_ptr<uint8_t>() + ip[r] * blocks.size(1), in_features / f.elems,
                     rows.data_ptr<float>() + r * in_features);
  });
  auto shape = ids.sizes().vec();
  shape.push_back(in_features);
  return rows.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("block_linear(Tensor x, Tensor blocks, int kind, Tensor? bias) -> Tensor");
  m.def("block_linear_out(Tensor x, Tensor blocks, int kind, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("block_rows(Tensor blocks, Tensor ids, int kind, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("block_linear", block_linear);
  m.impl("block_linear_out", [](const at::Tensor& x, const at::Tensor& b, int64_t kind, const c10::optional<at::Tensor>& bias,
                                at::Tensor y) { block_linear_out(x, b, kind, bias, y); });
  m.impl("block_rows", block_rows);
}
