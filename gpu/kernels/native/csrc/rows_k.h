// The K-quants' row kernels (blocks.cpp's driver calls them): one weight row's 256-element blocks (Q4_K, Q5_K, Q6_K)
// against R rows of Q8_K activations (blocks.h), each block's values unpacked once for the R rows; Q4_K's and Q5_K's
// decode, COLS weight rows against one activation row.
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

// The 32-bit sums of 8 vectors' lanes (lane c: v[c]'s), at once
inline __m256i sums8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
inline __m256i sums8(const __m128i* v) {
  const __m128i a = _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
  return _mm256_set_m128i(_mm_hadd_epi32(_mm_hadd_epi32(v[4], v[5]), _mm_hadd_epi32(v[6], v[7])), a);
}

// Q4_K's and Q5_K's decode (one activation row): COLS weight rows (`stride` bytes apart) at once, the row kernel's
// chains as a vector's lanes, the rows' integers of a block summed across their lanes together (sums8) rather than one
// by one: 1.2-1.8x a row at a time where the weights' reads leave compute the limit (one thread; weights in L3), the
// same at two threads from DRAM (bandwidth-bound either way). Q6_K's gained nothing and runs a row at a time.
constexpr int COLS = 8;

inline __m256 halves8(const uint8_t* w, int64_t stride) {  // (the f16 at w in each of the COLS rows)
  alignas(16) uint16_t h[COLS];
  for (int c = 0; c < COLS; ++c) std::memcpy(h + c, w + c * stride, 2);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// The part of the next COLS rows' bytes block b's pass asks for into L2 (`span` of them a block): COLS strided streams
// defeat the hardware's prefetch (from DRAM 16 GB/s without this, 28 with), this reads the next rows in order, a
// pass ahead (past a weight's end too: a prefetch never faults)
inline void prefetch_next(const uint8_t* next, int64_t b, int64_t span) {
  for (int64_t at = b * span; at < (b + 1) * span; at += 64) _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T1);
}

template <bool Five>
void q4_k_cols(const uint8_t* w, int64_t stride, const uint8_t* a, int64_t blocks, float* y) {
  __m256 S = _mm256_setzero_ps(), N = _mm256_setzero_ps();
  const uint8_t* next = w + COLS * stride;
  for (int64_t b = 0; b < blocks; ++b, w += Five ? 176 : 144, a += Q8K_BYTES) {
    prefetch_next(next, b, COLS * (Five ? 176 : 144));
    const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + Q8K_SUMS32));
    __m256i I[COLS];
    __m128i M[COLS];
    for (int c = 0; c < COLS; ++c) {
      __m128i m;
      I[c] = q4_k_unpack<Five>(w + c * stride, m).dot(a), M[c] = _mm_madd_epi16(m, sums);
    }
    const __m256 da = _mm256_set1_ps(f32(a));
    S = _mm256_fmadd_ps(_mm256_mul_ps(halves8(w, stride), da), _mm256_cvtepi32_ps(sums8(I)), S);
    N = _mm256_fmadd_ps(_mm256_mul_ps(halves8(w + 2, stride), da), _mm256_cvtepi32_ps(sums8(M)), N);
  }
  _mm256_storeu_ps(y, _mm256_sub_ps(S, N));
}

}  // namespace
