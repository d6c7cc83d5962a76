// GGUF's block formats as the native kernels read them (blocks.cpp: the products; block_values.cpp: the values): the
// formats' geometry, their scalar fields, the 32-element formats' nibbles and fifth bits, Q4_K's scale unpacking, and
// the 256-bit integer helpers both ISA builds use.
#pragma once
#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// ggml's type ids (gguf.GGMLQuantizationType)
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Q8_K, the K-quants' activations: f32 d, q i8[256], 16 int16 sums of 16 at Q8K_SUMS16, 8 of 32 at Q8K_SUMS32
constexpr int64_t Q8K_SUMS16 = 260, Q8K_SUMS32 = 292, Q8K_BYTES = 308;

struct Format {
  int64_t elems, bytes;  // a weight block's
  int64_t act_elems, act_bytes;  // an activation block's
};

Format format(int64_t kind) {
  switch (kind) {
    case Q4_0: return {32, 18, 32, 40};  // (activations, Q8_0's: f32 d widened from its f16, int32 sum of q, 32 q)
    case Q4_1: return {32, 20, 32, 40};
    case Q5_0: return {32, 22, 32, 40};
    case Q5_1: return {32, 24, 32, 40};
    case Q8_0: return {32, 34, 32, 40};
    case Q4_K: return {256, 144, 256, Q8K_BYTES};
    case Q5_K: return {256, 176, 256, Q8K_BYTES};
    case Q6_K: return {256, 210, 256, Q8K_BYTES};
    default: TORCH_CHECK(false, "block format ", kind, " has no kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K do)");
  }
}

inline float half(const uint8_t* p) {  // (F16C's vcvtph2ps: exact, as every f16 widens exactly)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// ---- integer products: 32 u8 x 32 i8 -> 8 int32 lanes (exact: every pair sum fits maddubs' int16; VNNI's dpbusd
// sums the same four products a lane) ----

inline __m256i loadu(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#if defined(__AVX512VNNI__)
inline __m256i dot_u8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#else
inline __m256i dot_u8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
#endif
inline __m256i dot_s8(__m256i w, __m256i a) { return dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)); }

inline float hmax(__m256 v) {  // (the largest lane)
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int hsum_i32(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
}

// The 32 4-bit values of a 32-element block's 16 bytes: low nibbles elements 0..15, high nibbles 16..31
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0xF));
}

// 0x10 at element j where bit j of the 32 at qh is set (Q5_0's and Q5_1's fifth bits; llama.cpp's bytes_from_bits_32)
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), which),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Q4_K's (and Q5_K's) 6-bit scale and min of sub-block j (gguf-py's Q4_K.get_scale_min)
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K's eight 6-bit scales (the low 128 bits, as int16, in both lanes) and mins (`mins`), unpacked at once in vector
// registers (the same values as scale_min): bytes P hold each one's low bits (sc 0-3: s[0..3] & 63, sc 4-7:
// s[8..11] & 15, m 0-3: s[4..7] & 63, m 4-7: s[8..11] >> 4), bytes Q the top two bits of sc 4-7 (s[0..3] >> 6) and
// of m 4-7 (s[4..7] >> 6)
inline __m256i q4_k_scales(const uint8_t* s, __m128i& mins) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // (12 bytes used: a block has 16 more)
  const __m128i p = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i q = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_and_si128(_mm_blend_epi32(p, _mm_srli_epi16(p, 4), 0b1000),
                                    _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m128i high = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(q, 6), _mm_set1_epi8(3)), 4);
  const __m256i both = _mm256_cvtepu8_epi16(_mm_or_si128(low, high));
  mins = _mm256_extracti128_si256(both, 1);
  const __m128i sc = _mm256_castsi256_si128(both);
  return _mm256_set_m128i(sc, sc);
}

// The sum over sub-blocks j of min_j x (the activations' sum over sub-block j): exact
inline int q4_k_mins(__m128i mins, const uint8_t* ab) {
  const __m128i p = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(ab + Q8K_SUMS32)));
  const __m128i s2 = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
}

}  // namespace
