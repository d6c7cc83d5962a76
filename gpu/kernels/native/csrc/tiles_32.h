// The 32-element formats' many-row products on AVX-512 VNNI (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): tiles_k.h's tiles
// (TR or TH activation rows x TC weight rows, an outer product per 4-byte group) on their blocks. A weight row's block
// is unpacked once per pass into its 32 unsigned codes u (rows_32.h), each group of 4 broadcast against the tile's
// rows' activation bytes (`vpdpbusd`); the block's exact integer is I = sum u a - offset x the activations' sum (Q8_0
// 128, Q4_0 8, Q5_0 16: the signed codes' sum, as the row kernels' sign trick gives it), then per (row, column)
// S = fma(d x da, float(I), S) and, for the _1 formats, N = fma(m x da, float(sum), N); y = S + N: rows_32.h's
// chains, so a row's value is the same in any tile, batch and ISA.
#pragma once
#include "rows_32.h"
#include "tiles_k.h"

#if defined(__AVX512VNNI__)
namespace {

// One block of a tile's activations (R rows of Q8_0's 40-byte blocks): q[g][r] = bytes 4g .. 4g + 3 of row r's 32;
// its d; its sum of q
template <int R>
struct alignas(64) Acts32 {
  int32_t q[8][R];
  float d[R];
  int32_t sum[R];
};

// One block of a weight row, unpacked: its 32 codes (unsigned), d, and m (the _1 formats'; 0 else)
struct alignas(64) Codes32 {
  uint8_t q[32];
  float d, m;
};

template <typename F>
void unpack32(const uint8_t* w, int64_t blocks, Codes32* out) {
  for (int64_t b = 0; b < blocks; ++b, w += F::bytes) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].q), F::u(w));
    out[b].d = half(w), out[b].m = F::has_min ? half(w + 2) : 0.0f;
  }
}

template <int R, int64_t Offset, bool Min>
void tile32(const Codes32* const* codes, const Acts32<R>* acts, int64_t blocks, int rows, int cols, float* y,
            int64_t ldy, const float* bias) {
  using L = Lanes<R>;
  typename L::F S[TC], N[TC];
  for (int c = 0; c < TC; ++c) S[c] = N[c] = L::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const Acts32<R>& a = acts[b];
    typename L::I I[TC];
    for (int c = 0; c < TC; ++c) I[c] = L::zero();
    for (int g = 0; g < 8; ++g) {
      const typename L::I av = L::load(a.q[g]);
      for (int c = 0; c < TC; ++c) I[c] = L::dpbusd(I[c], L::set1(group(codes[c][b].q + 4 * g)), av);
    }
    const typename L::I sum = L::load(a.sum);
    for (int c = 0; c < TC; ++c) {
      if (Offset) I[c] = L::sub(I[c], L::scale(sum, Offset));
      S[c] = L::chain(codes[c][b].d, a.d, I[c], S[c]);
      if (Min) N[c] = L::chain(codes[c][b].m, a.d, sum, N[c]);
    }
  }
  alignas(64) float v[R];
  for (int c = 0; c < cols; ++c) {
    L::store_sum(v, S[c], N[c]);
    for (int r = 0; r < rows; ++r) y[r * ldy + c] = bias ? v[r] + bias[c] : v[r];
  }
}

// The 32-element formats as a tile family (tiles_k.h's run_tiles)
struct Tiles32 {
  template <int R> using Acts = Acts32<R>;
  using Codes = Codes32;
  static constexpr int64_t act_bytes = 40;
  template <int R> static void transpose(const uint8_t* const* rows, int64_t blocks, Acts<R>* out) {
    for (int64_t b = 0; b < blocks; ++b)
      for (int r = 0; r < R; ++r) {
        const uint8_t* ab = rows[r] + b * act_bytes;
        std::memcpy(&out[b].d[r], ab, 4);
        std::memcpy(&out[b].sum[r], ab + 4, 4);
        for (int g = 0; g < 8; ++g) std::memcpy(&out[b].q[g][r], ab + 8 + 4 * g, 4);
      }
  }
  static void unpack(int64_t kind, const uint8_t* w, int64_t blocks, Codes* out) {
    if (kind == Q4_0) return unpack32<Q4_0f>(w, blocks, out);
    if (kind == Q4_1) return unpack32<Q4_1f>(w, blocks, out);
    if (kind == Q5_0) return unpack32<Q5_0f>(w, blocks, out);
    if (kind == Q5_1) return unpack32<Q5_1f>(w, blocks, out);
    unpack32<Q8_0f>(w, blocks, out);
  }
  template <int R>
  static void tile(int64_t kind, const Codes* const* codes, const Acts<R>* acts, int64_t blocks, int rows, int cols,
                   float* y, int64_t ldy, const float* bias) {
    if (kind == Q4_0) return tile32<R, Q4_0f::offset, false>(codes, acts, blocks, rows, cols, y, ldy, bias);
    if (kind == Q5_0) return tile32<R, Q5_0f::offset, false>(codes, acts, blocks, rows, cols, y, ldy, bias);
    if (kind == Q8_0) return tile32<R, Q8_0f::offset, false>(codes, acts, blocks, rows, cols, y, ldy, bias);
    tile32<R, 0, true>(codes, acts, blocks, rows, cols, y, ldy, bias);  // (Q4_1, Q5_1)
  }
};

}  // namespace
#endif
