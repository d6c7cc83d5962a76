// The K-quants' row kernels (blocks.cpp's driver calls them): one weight row's 256-element blocks (Q4_K, Q5_K, Q6_K)
// against R rows of Q8_K activations (blocks.h), each block's values unpacked once for the R rows.
//
// Per block and activation row, the exact integer I = sum of sc x q x a over the block (8 int32 lanes, lane i bytes
// 4i .. 4i + 3 of every 32-element group, then summed: AVX2 one group a vector, AVX-512 two; Q6_K's -32, 32 x sc x the
// activations' sums of 16, taken from it), and Q4_K's and Q5_K's M = sum of m x the activations' sums of 32. Then
// S = fma(d x da, float(I), S) and N = fma(dmin x da, float(M), N), a chain each per (row, column) over the blocks in
// order, and the value S - N: what every ISA build, tile and batch computes, the many-row tiles (tiles_k.h) too.
#pragma once
#include "blocks.h"

namespace {

#if defined(__AVX512VNNI__)
using Wide = __m512i;  // (two 32-element groups)
inline Wide load_wide(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Wide group_dot(Wide q, Wide a, Wide sc, Wide acc = _mm512_setzero_si512()) {  // (acc + sc x (q . a pairs))
  return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, a), sc);
}
inline __m256i narrow(Wide v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
inline Wide both(const uint8_t* p) { return _mm512_broadcast_i64x4(loadu(p)); }  // (32 bytes in both halves)
inline Wide halves(int16_t lo, int16_t hi) {  // (16-bit lanes: lo in the low half, hi in the high)
  return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
}
#else
using Wide = __m256i;
inline Wide load_wide(const uint8_t* p) { return loadu(p); }
inline Wide group_dot(Wide q, Wide a, Wide sc, Wide acc = _mm256_setzero_si256()) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), sc));
}
inline __m256i narrow(Wide v) { return v; }
#endif
constexpr int WIDE = sizeof(Wide) == 64 ? 4 : 8;  // (vectors a block)

// A block's 8 groups of unsigned values and their int16 scales, as the vectors the products take
struct Unpacked {
  Wide q[WIDE], sc[WIDE];
  __m256i dot(const uint8_t* ab) const {  // (the activations' q at ab + 4)
    Wide s = group_dot(q[0], load_wide(ab + 4), sc[0]);
    for (int v = 1; v < WIDE; ++v) s = group_dot(q[v], load_wide(ab + 4 + sizeof(Wide) * v), sc[v], s);
    return narrow(s);
  }
};

template <bool Five>  // (Q4_K; Five: Q5_K, whose fifth bits (bit j of byte l: element 32j + l) precede q)
__attribute__((always_inline)) inline Unpacked q4_k_unpack(const uint8_t* w, __m128i& mins) {
  const __m256i scales = q4_k_scales(w + 4, mins);
  const uint8_t* qs = w + (Five ? 48 : 16);
  Unpacked u;
#if defined(__AVX512VNNI__)
  const Wide low = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1), nibble = halves(0, 4);
  const Wide all = _mm512_broadcast_i64x4(scales);
  for (int c = 0; c < 4; ++c) {  // (groups 2c and 2c + 1: chunk c's low and high nibbles)
    u.q[c] = _mm512_and_si512(_mm512_srlv_epi16(both(qs + 32 * c), nibble), low);
    if (Five) {
      const Wide bit = _mm512_and_si512(_mm512_srlv_epi16(both(w + 16), halves(2 * c, 2 * c + 1)), one);
      u.q[c] = _mm512_or_si512(u.q[c], _mm512_slli_epi16(bit, 4));
    }
    const auto pick = [](int j) { return static_cast<int16_t>((2 * j + 1) << 8 | 2 * j); };
    u.sc[c] = _mm512_shuffle_epi8(all, halves(pick(2 * c), pick(2 * c + 1)));
  }
#else
  const __m256i low = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  for (int c = 0; c < 4; ++c) {
    const __m256i bytes = loadu(qs + 32 * c);
    u.q[2 * c] = _mm256_and_si256(bytes, low), u.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  }
  for (int j = 0; j < 8; ++j) {
    if (Five) {
      const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(loadu(w + 16), j), one);
      u.q[j] = _mm256_or_si256(u.q[j], _mm256_slli_epi16(bit, 4));
    }
    u.sc[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j)));
  }
#endif
  return u;
}

template <bool Five, int R>
void q4_k_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  float acc[R] = {}, mins[R] = {};
  for (int64_t b = 0; b < blocks; ++b, w += Five ? 176 : 144) {
    __m128i m;
    const Unpacked u = q4_k_unpack<Five>(w, m);
    const float d = half(w), dmin = half(w + 2);
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * Q8K_BYTES;
      const float da = f32(ab);
      acc[r] = std::fma(d * da, static_cast<float>(hsum_i32(u.dot(ab))), acc[r]);
      mins[r] = std::fma(dmin * da, static_cast<float>(q4_k_mins(m, ab)), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = acc[r] - mins[r];
}

__attribute__((always_inline)) inline Unpacked q6_k_unpack(const uint8_t* w, __m256i& sc16) {
  sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));  // (16 groups of 16)
  Unpacked u;
#if defined(__AVX512VNNI__)
  const Wide low = _mm512_set1_epi8(0xF), two = _mm512_set1_epi8(3), all = _mm512_castsi256_si512(sc16);
  for (int h = 0; h < 2; ++h) {  // (vector 2h: groups 32 x (4h, 4h + 1), low nibbles; 2h + 1: 4h + 2, 4h + 3, high)
    const Wide ql = _mm512_loadu_si512(w + 64 * h), hi = both(w + 128 + 32 * h);
    const Wide lows[2] = {_mm512_and_si512(ql, low), _mm512_and_si512(_mm512_srli_epi16(ql, 4), low)};
    for (int k = 0; k < 2; ++k) {
      const Wide high = _mm512_and_si512(_mm512_srlv_epi16(hi, halves(4 * k, 4 * k + 2)), two);
      u.q[2 * h + k] = _mm512_or_si512(lows[k], _mm512_slli_epi16(high, 4));
      const int v = 2 * h + k;  // (its 128-bit lane l: group 4v + l of 16)
      const auto g = [v](int l) { return static_cast<int64_t>((4 * v + l) * 0x0001000100010001ULL); };
      u.sc[v] = _mm512_permutexvar_epi16(_mm512_set_epi64(g(3), g(3), g(2), g(2), g(1), g(1), g(0), g(0)), all);
    }
  }
#else
  const __m256i low = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {  // (q[j]: elements 32j .. 32j + 31 (0..63); its two groups' scales as int16)
    const __m256i l0 = loadu(w + 64 * h), l1 = loadu(w + 64 * h + 32), hi = loadu(w + 128 + 32 * h);
    const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
    const __m128i half_scales = h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16);
    const __m256i pair = _mm256_set_m128i(half_scales, half_scales);  // (groups 8h .. 8h + 7)
    for (int k = 0; k < 4; ++k) {  // (scale 2k of the lane's 8 in the low lane, 2k + 1 in the high: a shuffle)
      const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>((4 * k + 1) << 8 | 4 * k)),
                                             _mm_set1_epi16(static_cast<int16_t>((4 * k + 3) << 8 | (4 * k + 2))));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), two);
      u.q[4 * h + k] = _mm256_or_si256(lows[k], _mm256_slli_epi16(high, 4));
      u.sc[4 * h + k] = _mm256_shuffle_epi8(pair, pick);
    }
  }
#endif
  return u;
}

template <int R>
void q6_k_row(const uint8_t* w, const uint8_t* const* a, int64_t blocks, float* y) {
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b, w += 210) {
    __m256i sc16;
    const Unpacked u = q6_k_unpack(w, sc16);
    const float d = half(w + 208);
    for (int r = 0; r < R; ++r) {
      const uint8_t* ab = a[r] + b * Q8K_BYTES;
      const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, loadu(ab + Q8K_SUMS16)), 5);  // (32 sc sums)
      const int total = hsum_i32(_mm256_sub_epi32(u.dot(ab), offset));
      acc[r] = std::fma(d * f32(ab), static_cast<float>(total), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = acc[r];
}

}  // namespace
