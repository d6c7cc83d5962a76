// The K-quants' many-row products on AVX-512 VNNI (blocks.cpp runs them on the tiles of TR activation rows, a last
// one of PAD rows or more padded; the rows left over, and the AVX2 build, take the row kernels of rows_k.h): the same
// numbers as those, bit for bit.
//
// A tile is TR activation rows x TC weight rows (output columns), an outer product per 4-byte group: one vector holds
// the group's 4 activation bytes of each of the TR rows (the activations transposed per block: Acts), and each weight
// row's 4 codes of it (its block unpacked once per pass into unsigned codes: Codes) are broadcast against it,
// `vpdpbusd` summing the 4 products into each row's lane. A sub-block's sums are scaled by its scale (vpmulld) into
// the block's exact integer I; Q6_K's -32 and Q4_K's and Q5_K's mins come from the activations' sums (vpdpwssd).
// Then S = fma(d x da, float(I), S) and N = fma(dmin x da, float(M), N) per (row, column), block by block: rows_k.h's
// chains, so a row's value is S - N in any tile, batch and ISA.
#pragma once
#include "rows_k.h"

#if defined(__AVX512VNNI__)
namespace {

constexpr int TR = 16;  // activation rows a tile (an int32 lane each)
constexpr int TC = 8;   // weight rows a tile
constexpr int PAD = 8;  // a last tile of fewer rows is run if it has this many (its other lanes zeros, not written)

inline int64_t tiled_rows(int64_t rows) { return rows % TR >= PAD ? rows : rows / TR * TR; }  // (the rows tiles take)

// One block of a tile's activations: q[g][r] = bytes 4g .. 4g + 3 of row r's block; its d; s32[k][r] its sums of 32
// of sub-blocks 2k and 2k + 1 (an int16 pair); s16[k][r] its sums of 16, 2k and 2k + 1
struct alignas(64) Acts {
  int32_t q[64][TR];
  float d[TR];
  int32_t s32[4][TR];
  int32_t s16[8][TR];
};

// One block of a weight row, unpacked: its 256 codes in element order (unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63),
// its sub-block scales as int32 (Q4_K, Q5_K: 8 of 32; Q6_K: 16 of 16), pairs for vpdpwssd (Q4_K, Q5_K: the mins,
// 4 pairs; Q6_K: its scales, 8 pairs, for the -32), d and dmin
struct alignas(64) Codes {
  uint8_t q[256];
  int32_t sc[16];
  int32_t pairs[8];
  float d, dmin;
};

// TR rows of Q8_K activations (blocks.cpp's quantize_q8_k) into `blocks` Acts
void transpose(const uint8_t* const* rows, int64_t blocks, Acts* out) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < TR; ++r) {
      const uint8_t* ab = rows[r] + b * Q8K_BYTES;
      std::memcpy(&out[b].d[r], ab, 4);
      for (int g = 0; g < 64; ++g) std::memcpy(&out[b].q[g][r], ab + 4 + 4 * g, 4);
      for (int k = 0; k < 4; ++k) std::memcpy(&out[b].s32[k][r], ab + Q8K_SUMS32 + 4 * k, 4);
      for (int k = 0; k < 8; ++k) std::memcpy(&out[b].s16[k][r], ab + Q8K_SUMS16 + 4 * k, 4);
    }
}

// A weight row's `blocks` blocks of format `kind` into Codes
void unpack(int64_t kind, const uint8_t* w, int64_t blocks, Codes* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    Codes& c = out[b];
    Unpacked u;
    if (kind == Q6_K) {
      __m256i sc16;  // (int16: stored as int32 each, and as the pairs)
      u = q6_k_unpack(w, sc16);
      _mm512_store_si512(c.sc, _mm512_cvtepi16_epi32(sc16));
      _mm256_store_si256(reinterpret_cast<__m256i*>(c.pairs), sc16);
      c.d = half(w + 208), c.dmin = 0.0f, w += 210;
    } else {
      __m128i mins;  // (int16 pairs, as stored)
      u = kind == Q5_K ? q4_k_unpack<true>(w, mins) : q4_k_unpack<false>(w, mins);
      _mm256_store_si256(reinterpret_cast<__m256i*>(c.sc), _mm256_cvtepi16_epi32(_mm256_castsi256_si128(q4_k_scales(w + 4, mins))));
      _mm_store_si128(reinterpret_cast<__m128i*>(c.pairs), mins);
      c.d = half(w), c.dmin = half(w + 2), w += kind == Q5_K ? 176 : 144;
    }
    for (int v = 0; v < WIDE; ++v) _mm512_store_si512(c.q + 64 * v, u.q[v]);
  }
}

inline __m512i bcast(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[r][c] for the tile's first `rows` <= TR rows (acts) and `cols` <= TC weight rows (codes[c]: each `blocks` long),
// at y's stride ldy
template <bool Six>
void tile(const Codes* const* codes, const Acts* acts, int64_t blocks, int rows, int cols, float* y, int64_t ldy,
          const float* bias) {
  constexpr int SUB = Six ? 16 : 8, GROUPS = 64 / SUB;  // (sub-blocks a block, 4-byte groups a sub-block)
  __m512 S[TC], N[TC];
  for (int c = 0; c < TC; ++c) S[c] = N[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Acts& a = acts[b];
    __m512i I[TC];
    for (int c = 0; c < TC; ++c) I[c] = _mm512_setzero_si512();
    for (int j = 0; j < SUB; ++j) {
      __m512i part[TC];
      for (int c = 0; c < TC; ++c) part[c] = _mm512_setzero_si512();
      for (int g = GROUPS * j; g < GROUPS * (j + 1); ++g) {
        const __m512i av = _mm512_load_si512(a.q[g]);
        for (int c = 0; c < TC; ++c) part[c] = _mm512_dpbusd_epi32(part[c], bcast(codes[c][b].q + 4 * g), av);
      }
      for (int c = 0; c < TC; ++c) I[c] = _mm512_add_epi32(I[c], _mm512_mullo_epi32(part[c], _mm512_set1_epi32(codes[c][b].sc[j])));
    }
    const __m512 da = _mm512_load_ps(a.d);
    for (int c = 0; c < TC; ++c) {
      const Codes& w = codes[c][b];
      __m512i M = _mm512_setzero_si512();
      for (int k = 0; k < (Six ? 8 : 4); ++k)
        M = _mm512_dpwssd_epi32(M, _mm512_load_si512(Six ? a.s16[k] : a.s32[k]), _mm512_set1_epi32(w.pairs[k]));
      if (Six) I[c] = _mm512_sub_epi32(I[c], _mm512_slli_epi32(M, 5));
      S[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w.d), da), _mm512_cvtepi32_ps(I[c]), S[c]);
      if (!Six) N[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w.dmin), da), _mm512_cvtepi32_ps(M), N[c]);
    }
  }
  alignas(64) float v[TR];
  for (int c = 0; c < cols; ++c) {
    _mm512_store_ps(v, _mm512_sub_ps(S[c], N[c]));
    for (int r = 0; r < rows; ++r) y[r * ldy + c] = bias ? v[r] + bias[c] : v[r];
  }
}

// The first `rows` (tiled_rows) rows of y = x W^T + bias for a K-quant weight (act: x's rows as Q8_K activations)
void k_tiles(int64_t kind, const uint8_t* act, int64_t rows, const uint8_t* wp, int64_t out, int64_t nb, float* yp,
             int64_t ldy, const float* bp) {
  const int64_t wbytes = nb * format(kind).bytes, tiles = (rows + TR - 1) / TR;
  std::vector<Acts> acts(tiles * nb);
  const std::vector<uint8_t> zeros(rows % TR ? nb * Q8K_BYTES : 0);  // (a last tile's missing rows)
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* from[TR];
      for (int r = 0; r < TR; ++r) from[r] = t * TR + r < rows ? act + (t * TR + r) * nb * Q8K_BYTES : zeros.data();
      transpose(from, nb, acts.data() + t * nb);
    }
  });
  at::parallel_for(0, (out + TC - 1) / TC, 1, [&](int64_t begin, int64_t end) {
    std::vector<Codes> held(TC * nb);
    const Codes* codes[TC];
    for (int c = 0; c < TC; ++c) codes[c] = held.data() + c * nb;
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(TC, out - p * TC));
      for (int c = 0; c < TC; ++c) {
        if (c < cols) unpack(kind, wp + (p * TC + c) * wbytes, nb, held.data() + c * nb);
        else std::memset(static_cast<void*>(held.data() + c * nb), 0, nb * sizeof(Codes));  // (nothing written)
      }
      for (int64_t t = 0; t < tiles; ++t) {
        float* y = yp + t * TR * ldy + p * TC;
        const float* bias = bp ? bp + p * TC : nullptr;
        const int n = static_cast<int>(std::min<int64_t>(TR, rows - t * TR));
        kind == Q6_K ? tile<true>(codes, acts.data() + t * nb, nb, n, cols, y, ldy, bias)
                     : tile<false>(codes, acts.data() + t * nb, nb, n, cols, y, ldy, bias);
      }
    }
  });
}

}  // namespace
#endif
