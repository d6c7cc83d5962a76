// The K-quants' many-row products on AVX-512 VNNI (blocks.cpp runs them on tiles of TR activation rows, 512-bit, and
// a last one padded, or a half tile of TH rows, 256-bit: batched decode at 8 rows; the rows left over, and the AVX2
// build, take the row kernels of rows_k.h): the same numbers as those, bit for bit.
//
// A tile is R (TR or TH) activation rows x TC weight rows (output columns), an outer product per 4-byte group: one vector holds
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

constexpr int TR = 16;  // activation rows a full tile (an int32 lane each of a 512-bit vector) ...
constexpr int TH = 8;   // ... and a half tile's (256-bit: Zen 4 runs a 512-bit op as two halves, so 8 rows padded
                        // into a full tile cost as much as 16)
constexpr int TC = 8;   // weight rows a tile

// The rows tiles take: full tiles, then the rest where TH or more are left: a half tile where TH are, else a last full
// tile padded (its other lanes zeros, not written); fewer take the row kernels. (Q4_K at 8 rows: a half tile 1.13x the
// padded full one on Zen 4; at 4 rows a padded half tile is 0.63x the row kernels: a tile's unpacking of its weight
// rows is shared by fewer rows.)
inline int64_t tiled_rows(int64_t rows) { return rows % TR >= TH ? rows : rows / TR * TR; }

// One tile's vector ops at R rows: 512-bit vectors for TR, 256-bit (AVX512-VL) for TH
template <int R> struct Lanes;
#define SLUICE_LANES(R, P, SI)                                                                        \
  template <> struct Lanes<R> {                                                                       \
    using I = decltype(P##setzero_##SI());                                                            \
    using F = decltype(P##setzero_ps());                                                              \
    static I zero() { return P##setzero_##SI(); }                                                     \
    static I load(const int32_t* p) { return P##load_##SI(reinterpret_cast<const I*>(p)); }           \
    static I set1(int32_t v) { return P##set1_epi32(v); }                                             \
    static I dpbusd(I acc, I u, I s) { return P##dpbusd_epi32(acc, u, s); }                           \
    static I dpwssd(I acc, I a, I b) { return P##dpwssd_epi32(acc, a, b); }                           \
    static I scale(I a, int32_t k) { return P##mullo_epi32(a, P##set1_epi32(k)); }                   \
    static I add(I a, I b) { return P##add_epi32(a, b); }                                             \
    static I sub(I a, I b) { return P##sub_epi32(a, b); }                                             \
    static I minus32(I a, I m) { return P##sub_epi32(a, P##slli_epi32(m, 5)); }                      \
    static F fzero() { return P##setzero_ps(); }                                                      \
    static F chain(float wd, const float* da, I v, F acc) {                                           \
      return P##fmadd_ps(P##mul_ps(P##set1_ps(wd), P##load_ps(da)), P##cvtepi32_ps(v), acc);          \
    }                                                                                                 \
    static void store_diff(float* out, F a, F b) { P##store_ps(out, P##sub_ps(a, b)); }               \
    static void store_sum(float* out, F a, F b) { P##store_ps(out, P##add_ps(a, b)); }                \
  };
SLUICE_LANES(TR, _mm512_, si512)
SLUICE_LANES(TH, _mm256_, si256)
#undef SLUICE_LANES

// One block of a tile's activations (R rows): q[g][r] = bytes 4g .. 4g + 3 of row r's block; its d; s32[k][r] its sums
// of 32 of sub-blocks 2k and 2k + 1 (an int16 pair); s16[k][r] its sums of 16, 2k and 2k + 1
template <int R>
struct alignas(64) Acts {
  int32_t q[64][R];
  float d[R];
  int32_t s32[4][R];
  int32_t s16[8][R];
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

// R rows of Q8_K activations (blocks.cpp's quantize_q8_k) into `blocks` Acts
template <int R>
void transpose(const uint8_t* const* rows, int64_t blocks, Acts<R>* out) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < R; ++r) {
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

inline int32_t group(const uint8_t* p) {  // (a weight row's 4 codes of a group, to broadcast)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// y[r][c] for the tile's first `rows` <= R rows (acts) and `cols` <= TC weight rows (codes[c]: each `blocks` long),
// at y's stride ldy
template <int R, bool Six>
void tile(const Codes* const* codes, const Acts<R>* acts, int64_t blocks, int rows, int cols, float* y, int64_t ldy,
          const float* bias) {
  using L = Lanes<R>;
  constexpr int SUB = Six ? 16 : 8, GROUPS = 64 / SUB;  // (sub-blocks a block, 4-byte groups a sub-block)
  typename L::F S[TC], N[TC];
  for (int c = 0; c < TC; ++c) S[c] = N[c] = L::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const Acts<R>& a = acts[b];
    typename L::I I[TC];
    for (int c = 0; c < TC; ++c) I[c] = L::zero();
    for (int j = 0; j < SUB; ++j) {
      typename L::I part[TC];
      for (int c = 0; c < TC; ++c) part[c] = L::zero();
      for (int g = GROUPS * j; g < GROUPS * (j + 1); ++g) {
        const typename L::I av = L::load(a.q[g]);
        for (int c = 0; c < TC; ++c) part[c] = L::dpbusd(part[c], L::set1(group(codes[c][b].q + 4 * g)), av);
      }
      for (int c = 0; c < TC; ++c) I[c] = L::add(I[c], L::scale(part[c], codes[c][b].sc[j]));
    }
    for (int c = 0; c < TC; ++c) {
      const Codes& w = codes[c][b];
      typename L::I M = L::zero();
      for (int k = 0; k < (Six ? 8 : 4); ++k) M = L::dpwssd(M, L::load(Six ? a.s16[k] : a.s32[k]), L::set1(w.pairs[k]));
      if (Six) I[c] = L::minus32(I[c], M);
      S[c] = L::chain(w.d, a.d, I[c], S[c]);
      if (!Six) N[c] = L::chain(w.dmin, a.d, M, N[c]);
    }
  }
  alignas(64) float v[R];
  for (int c = 0; c < cols; ++c) {
    L::store_diff(v, S[c], N[c]);
    for (int r = 0; r < rows; ++r) y[r * ldy + c] = bias ? v[r] + bias[c] : v[r];
  }
}

// The K-quants as a tile family (run_tiles): their activations' blocks, a weight row's unpacked blocks, the tile
struct KQuantTiles {
  template <int R> using Acts = ::Acts<R>;
  using Codes = ::Codes;
  static constexpr int64_t act_bytes = Q8K_BYTES;
  template <int R> static void transpose(const uint8_t* const* rows, int64_t blocks, Acts<R>* out) {
    ::transpose<R>(rows, blocks, out);
  }
  static void unpack(int64_t kind, const uint8_t* w, int64_t blocks, Codes* out) { ::unpack(kind, w, blocks, out); }
  template <int R>
  static void tile(int64_t kind, const Codes* const* codes, const Acts<R>* acts, int64_t blocks, int rows, int cols,
                   float* y, int64_t ldy, const float* bias) {
    kind == Q6_K ? ::tile<R, true>(codes, acts, blocks, rows, cols, y, ldy, bias)
                 : ::tile<R, false>(codes, acts, blocks, rows, cols, y, ldy, bias);
  }
};

// The first `rows` (tiled_rows) rows of y = x W^T + bias on a family's tiles (K: KQuantTiles, tiles_32.h's Tiles32;
// act: x's rows as its activations' blocks): full tiles, then a last full or half one
template <typename K>
void run_tiles(int64_t kind, const uint8_t* act, int64_t rows, const uint8_t* wp, int64_t out, int64_t nb, float* yp,
               int64_t ldy, const float* bp) {
  const int64_t wbytes = nb * format(kind).bytes, left = rows % TR, full = rows / TR + (left > TH);
  const bool half = left == TH;
  std::vector<typename K::template Acts<TR>> acts(full * nb);
  std::vector<typename K::template Acts<TH>> last(half ? nb : 0);
  const std::vector<uint8_t> zeros(left ? nb * K::act_bytes : 0);  // (a last tile's missing rows)
  auto gather = [&](int64_t t, auto* into) {  // (tile t's rows, as `into`'s R rows)
    constexpr int R = sizeof(into->d) / sizeof(float);
    const uint8_t* from[R];
    for (int r = 0; r < R; ++r) from[r] = t * TR + r < rows ? act + (t * TR + r) * nb * K::act_bytes : zeros.data();
    K::template transpose<R>(from, nb, into);
  };
  at::parallel_for(0, full + half, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) t < full ? gather(t, acts.data() + t * nb) : gather(t, last.data());
  });
  at::parallel_for(0, (out + TC - 1) / TC, 1, [&](int64_t begin, int64_t end) {
    std::vector<typename K::Codes> held(TC * nb);
    const typename K::Codes* codes[TC];
    for (int c = 0; c < TC; ++c) codes[c] = held.data() + c * nb;
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(TC, out - p * TC));
      for (int c = 0; c < TC; ++c) {
        if (c < cols) K::unpack(kind, wp + (p * TC + c) * wbytes, nb, held.data() + c * nb);
        else std::memset(static_cast<void*>(held.data() + c * nb), 0, nb * sizeof(typename K::Codes));  // (not written)
      }
      const float* bias = bp ? bp + p * TC : nullptr;
      for (int64_t t = 0; t < full + half; ++t) {
        float* y = yp + t * TR * ldy + p * TC;
        const int n = static_cast<int>(std::min<int64_t>(TR, rows - t * TR));
        t < full ? K::template tile<TR>(kind, codes, acts.data() + t * nb, nb, n, cols, y, ldy, bias)
                 : K::template tile<TH>(kind, codes, last.data(), nb, n, cols, y, ldy, bias);
      }
    }
  });
}

}  // namespace
#endif
