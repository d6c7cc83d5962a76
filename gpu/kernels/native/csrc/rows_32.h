// The 32-element formats' products on the row kernels (blocks.cpp: both ISA builds): one block layout each (its
// codes as unsigned bytes and its value), one weight row against R activation rows (row32), and COLS weight rows
// against one (cols32: decode). Every (row, column) is one float32 chain over the blocks, so a tile (tiles_32.h)
// gives the same bits.
#pragma once
#include "rows_k.h"

namespace {

// The 32-element formats: each block's 32 codes as unsigned bytes `u` (Q8_0's q + 128, the nibbles, with Q5's fifth
// bits), their value d (u - offset) (`offset` 128, 8, 16), or d u + m (the _1 formats, `has_min`: m times the
// activations' sum is a second chain); `q` the signed u - offset where it has one.
struct Q4_0f {
  static constexpr int64_t bytes = 18, offset = 8;
  static constexpr bool has_min = false;
  static __m256i u(const uint8_t* w) { return nibbles(w + 2); }
};
struct Q4_1f {
  static constexpr int64_t bytes = 20, offset = 0;
  static constexpr bool has_min = true;
  static __m256i u(const uint8_t* w) { return nibbles(w + 4); }
};
struct Q5_0f {
  static constexpr int64_t bytes = 22, offset = 16;
  static constexpr bool has_min = false;
  static __m256i u(const uint8_t* w) { return _mm256_or_si256(nibbles(w + 6), fifth_bits(w + 2)); }
};
struct Q5_1f {
  static constexpr int64_t bytes = 24, offset = 0;
  static constexpr bool has_min = true;
  static __m256i u(const uint8_t* w) { return _mm256_or_si256(nibbles(w + 8), fifth_bits(w + 4)); }
};
struct Q8_0f {
  static constexpr int64_t bytes = 34, offset = 128;
  static constexpr bool has_min = false;
  static __m256i u(const uint8_t* w) { return _mm256_xor_si256(loadu(w + 2), _mm256_set1_epi8(-128)); }
};
template <typename F>
inline __m256i dot32(const uint8_t* w, __m256i a) {  // (a block's exact integer sum with activations a, 8 lanes)
  if constexpr (F::has_min) return dot_u8(F::u(w), a);
  return dot_s8(F::offset == 128 ? loadu(w + 2) : _mm256_sub_epi8(F::u(w), _mm256_set1_epi8(F::offset)), a);
}

// One weight row's blocks against R <= 8 activation rows: per row a chain over the blocks, S = fma(d da, I, S) of each
// block's exact integer I (and N = fma(m da, sum, N)), y = S + N, the rows' chains a vector's lanes (their integers
// summed across lanes together: sums8): a tile's (tiles_32.h) and COLS rows' (cols32) chains.
template <typename F, int R>
void row32(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  static_assert(R <= 8, "a lane a row");
  __m256 S = _mm256_setzero_ps(), N = _mm256_setzero_ps();
  __m256i I[8];
  for (int r = R; r < 8; ++r) I[r] = _mm256_setzero_si256();
  float da[8] = {};
  int32_t sum[8] = {};
  for (int64_t b = 0; b < blocks; ++b, w += F::bytes) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * 40;
      I[r] = dot32<F>(w, loadu(ab + 8)), da[r] = f32(ab);
      if (F::has_min) std::memcpy(&sum[r], ab + 4, 4);
    }
    // (built from registers: a vector load of the scalars just stored would stall on store forwarding)
    const __m256 dav = _mm256_setr_ps(da[0], da[1], da[2], da[3], da[4], da[5], da[6], da[7]);
    S = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half(w)), dav), _mm256_cvtepi32_ps(sums8(I)), S);
    if (F::has_min) {
      const __m256i sums = _mm256_setr_epi32(sum[0], sum[1], sum[2], sum[3], sum[4], sum[5], sum[6], sum[7]);
      N = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half(w + 2)), dav), _mm256_cvtepi32_ps(sums), N);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_add_ps(S, N));
  for (int r = 0; r < R; ++r) y[r] = out[r];
}

// Decode (one activation row): COLS weight rows (`stride` bytes apart) at once, row32's chains as a vector's lanes
template <typename F>
void cols32(const uint8_t* w, int64_t stride, const uint8_t* a, int64_t blocks, float* y) {
  __m256 S = _mm256_setzero_ps(), N = _mm256_setzero_ps();
  const uint8_t* next = w + COLS * stride;
  for (int64_t b = 0; b < blocks; ++b, w += F::bytes, a += 40) {
    prefetch_next(next, b, COLS * F::bytes);
    const __m256i av = loadu(a + 8);
    __m256i I[COLS];
    for (int c = 0; c < COLS; ++c) I[c] = dot32<F>(w + c * stride, av);
    const __m256 da = _mm256_set1_ps(f32(a));
    S = _mm256_fmadd_ps(_mm256_mul_ps(halves8(w, stride), da), _mm256_cvtepi32_ps(sums8(I)), S);
    if (F::has_min) {
      int32_t sum;
      std::memcpy(&sum, a + 4, 4);
      N = _mm256_fmadd_ps(_mm256_mul_ps(halves8(w + 2, stride), da), _mm256_set1_ps(static_cast<float>(sum)), N);
    }
  }
  _mm256_storeu_ps(y, _mm256_add_ps(S, N));
}

void cols_dot(int64_t kind, const uint8_t* w, int64_t stride, const uint8_t* a, int64_t blocks, float* y) {
  if (kind == Q4_0) return cols32<Q4_0f>(w, stride, a, blocks, y);
  if (kind == Q4_1) return cols32<Q4_1f>(w, stride, a, blocks, y);
  if (kind == Q5_0) return cols32<Q5_0f>(w, stride, a, blocks, y);
  if (kind == Q5_1) return cols32<Q5_1f>(w, stride, a, blocks, y);
  if (kind == Q8_0) return cols32<Q8_0f>(w, stride, a, blocks, y);
  TORCH_CHECK(kind == Q4_K || kind == Q5_K, "cols_dot: format ", kind);
  kind == Q5_K ? q4_k_cols<true>(w, stride, a, blocks, y) : q4_k_cols<false>(w, stride, a, blocks, y);
}

}  // namespace
