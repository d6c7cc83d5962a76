// The vector types the kernels are written in, for the ISA this library is built for (gpu/kernels/native/build.py builds
// it twice: -mavx2 -mfma -mf16c, and -mavx512f/bw/dq/vl/vnni; -ffp-contract=off: no fma the source does not write).
//
// - Vec: the machine's widest float vector (8 or 16 lanes): the linear kernels, whose per-element results are single
//   lanes' fma chains and so do not depend on the width; loaded from float32s or, widened exactly, from bfloat16s
//   (2 x LANES of them a load: a float from the low or the high half of each 32 bits, by a shift or a mask) or
//   float16s (F16C's vcvtph2ps).
// - V16: sixteen float lanes on either ISA (one __m512, or two __m256 side by side), for kernels that reduce across
//   lanes (attention's dot products and softmax): every operation, the reductions' trees and the exponential's
//   polynomial included, is the same IEEE arithmetic lane by lane on both ISAs, so their results are the same bits.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {  // (internal linkage: V16 is another type in each ISA's library)
namespace simd {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vlow16(const uint16_t* p) {  // of 2 x LANES bfloat16s, those in the low halves of 32 bits, as floats
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
inline Vec vhigh16(const uint16_t* p) {  // ... and those in the high halves
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(-65536)));
}
inline Vec vhalf(const uint16_t* p) {  // LANES float16s (their bits), widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load16(const float* p, int n) {  // the first n lanes (the rest 0)
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p)};
}
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 max16(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // (b where either is NaN; so is min16)
inline V16 min16(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 round16(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 pow2_16(V16 n) {  // 2^n for integral n in [-126, 127]
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline __m256 half8(V16 a, int hi) { return hi ? _mm512_extractf32x8_ps(a.v, 1) : _mm512_castps512_ps256(a.v); }
inline void store16(float* p, V16 a, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), a.v); }
inline V16 div16(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 neg_abs16(V16 a) {  // -|a|: the sign bit set
  return {_mm512_castsi512_ps(_mm512_or_epi32(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}
inline V16 first16(V16 a, int n, float rest) {  // a's lanes < n, `rest` in the others (any n)
  const __mmask16 keep = n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
  return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(rest), a.v)};
}
inline V16 select_ge0_16(V16 z, V16 a, V16 b) {  // a where z >= 0, else b
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(z.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)};
}
#else
using Vec = __m256;
constexpr int64_t LANES = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vlow16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
inline Vec vhigh16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi32(-65536)));
}
inline Vec vhalf(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

struct V16 {
  __m256 lo, hi;
};
inline __m256 mask8(int n) {  // lanes < n set
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
}
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load16(const float* p, int n) {
  const __m256 lo = _mm256_maskload_ps(p, _mm256_castps_si256(mask8(n)));
  return {lo, n > 8 ? _mm256_maskload_ps(p + 8, _mm256_castps_si256(mask8(n - 8))) : _mm256_setzero_ps()};
}
inline void store16(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 max16(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 min16(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 round16(V16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 pow2_16(V16 n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline __m256 half8(V16 a, int hi) { return hi ? a.hi : a.lo; }
inline void store16(float* p, V16 a, int n) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(mask8(n)), a.lo);
  if (n > 8) _mm256_maskstore_ps(p + 8, _mm256_castps_si256(mask8(n - 8)), a.hi);
}
inline V16 div16(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 neg_abs16(V16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(a.lo, sign), _mm256_or_ps(a.hi, sign)};
}
inline V16 first16(V16 a, int n, float rest) {
  const __m256 r = _mm256_set1_ps(rest);
  return {_mm256_blendv_ps(r, a.lo, mask8(n)), _mm256_blendv_ps(r, a.hi, mask8(n - 8))};
}
inline V16 select_ge0_16(V16 z, V16 a, V16 b) {
  const __m256 zero = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(z.lo, zero, _CMP_GE_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(z.hi, zero, _CMP_GE_OQ))};
}
#endif

// A bfloat16 (its bits) widened to float32: exact, the high half of the float.
inline float bf16(uint16_t b) {
  const uint32_t high = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &high, sizeof f);
  return f;
}

// Lanes d .. d + 15 of a row of dim floats (0 past dim).
inline V16 lanes(const float* p, int64_t d, int64_t dim) {
  return d + 16 <= dim ? load16(p + d) : load16(p + d, static_cast<int>(dim - d));
}

// The sum of the 16 lanes by one tree on both ISAs: lane i + lane i+8, then i + i+4, i + i+2, i + i+1.
inline float sum16(V16 a) {
  const __m256 s8 = _mm256_add_ps(half8(a, 0), half8(a, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// The largest lane (exact in any order).
inline float max16(V16 a) {
  const __m256 m8 = _mm256_max_ps(half8(a, 0), half8(a, 1));
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}

// e^x lane by lane for x <= 0 (softmax's shifted scores; below -87 it returns 2^-126 x e^r, not 0): x = n ln2 + r,
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n. NaN stays NaN, as in
// torch (the floor is max's first operand: maxps returns the second where either is NaN).
inline V16 exp16(V16 x) {
  x = max16(set16(-87.0f), x);
  const V16 n = round16(mul16(x, set16(1.44269504088896341f)));
  V16 r = fma16(n, set16(-0.693359375f), x);  // ln2 in two parts: the first exact in float
  r = fma16(n, set16(2.12194440e-4f), r);
  V16 p = set16(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fma16(p, r, set16(c));
  return mul16(p, pow2_16(n));
}

// 1 / (1 + e^-z) lane by lane, by exp16 of -|z| only (never overflows): e^-|z| / (1 + e^-|z|) where z < 0 (below
// z = -87, ~1.6e-38 rather than ~0: exp16's floor).
inline V16 sigmoid16(V16 z) {
  const V16 t = exp16(neg_abs16(z)), one = set16(1.0f);
  return div16(select_ge0_16(z, one, t), add16(one, t));
}

// GELU in erf's exact form, x Phi(x), lane by lane, from erfc(|x| / sqrt 2) alone (no cancellation on either side):
// g = x / 2 erfc(|x| / sqrt 2) where x < 0, x - g elsewhere. erfc(z) = t e^(-z^2 + P(t)), t = 1 / (1 + z / 2), P
// Numerical Recipes' Chebyshev fit of degree 9 (fractional error < 1.2e-7 for every z >= 0). g from x clamped to
// [-20, 20] (erfc is 0 in float past it: +inf stays inf; NaN stays NaN); below about -13, ~-1e-38 rather than -0
// (exp16's floor).
inline V16 gelu16(V16 x) {
  const V16 xc = min16(set16(20.0f), max16(set16(-20.0f), x));  // (x's NaN passes: the second operand)
  const V16 minus_z = mul16(neg_abs16(xc), set16(0.70710678118654752f));
  const V16 t = div16(set16(1.0f), fma16(minus_z, set16(-0.5f), set16(1.0f)));
  V16 p = set16(0.17087277f);
  for (const float c : {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f, 0.09678418f, 0.37409196f,
                        1.00002368f, -1.26551223f})
    p = fma16(p, t, set16(c));
  const V16 g = mul16(mul16(xc, set16(0.5f)), mul16(t, exp16(fma16(minus_z, sub16(zero16(), minus_z), p))));
  return select_ge0_16(x, sub16(x, g), g);
}

}  // namespace simd
}  // namespace
