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
// y[r, o] = bias[o] + the sum over blocks of the products' exact integer sums (maddubs/madd or VNNI's dpbusd) times
// the block's scales, one float32 chain per (row, column) over the blocks (the K-quants': rows_k.h; the many-row
// tiles of tiles_k.h and tiles_32.h on AVX-512 VNNI, COLS weight rows at once for one activation row).
// An element's rounding depends on nothing but its row and column (any batch, thread, tile, ISA: the same bits). A
// NaN or infinite activation makes its block's scale NaN: its row's outputs are NaN (and only its row's). Threads
// split the weight's rows; RT activation rows (in L1) share each weight block's unpacking, a megabyte of weight rows
// stays in L2 while the row tiles pass.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "blocks.h"
#include "rows_32.h"
#include "tiles_32.h"

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
    const bool scaled = finite && std::isfinite(id);  // (a d too small for 1 / d: its f16 is 0, q 0)
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const auto q = static_cast<int8_t>(scaled ? std::round(x[i] * id) : 0);
      out[8 + i] = static_cast<uint8_t>(q), sum += q;
    }
    std::memcpy(out, &dh, 4), std::memcpy(out + 4, &sum, 4);
  }
}

void quantize_q8_k(const float* x, int64_t in, uint8_t* out) {
  for (int64_t b = 0; b < in / 256; ++b, x += 256, out += Q8K_BYTES) {
    // (in 8-lane vectors: amax the largest |x|, max the first x of that size; q = min(127, nearbyint(iscale x)))
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 top = zero, ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 256; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ));  // (x - x: NaN where not finite)
    }
    const bool finite = _mm256_movemask_ps(ok) == 0xFF;
    float amax = hmax(top), max = 0.0f;
    for (int i = 0; finite && amax != 0.0f && i < 256; i += 8) {
      const int at = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)),
                                                      _mm256_set1_ps(amax), _CMP_EQ_OQ));
      if (at) {
        max = x[i + __builtin_ctz(at)];
        break;
      }
    }
    auto* q = reinterpret_cast<int8_t*>(out + 4);
    const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
    const __m256 scale = _mm256_set1_ps(iscale), limit = _mm256_set1_ps(127.0f);
    const bool scaled = finite && std::isfinite(iscale);  // (a max under 127 / FLT_MAX: q 0, as llama.cpp's)
    if (!scaled) std::memset(q, 0, 256);
    for (int i = 0; scaled && i < 256; i += 32) {
      __m256i n[4];
      for (int k = 0; k < 4; ++k)
        n[k] = _mm256_cvtps_epi32(_mm256_min_ps(
            limit, _mm256_round_ps(_mm256_mul_ps(scale, _mm256_loadu_ps(x + i + 8 * k)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    const float d = !finite ? NAN : amax != 0.0f ? 1.0f / iscale : 0.0f;
    std::memcpy(out, &d, 4);
    int16_t sums[16 + 8];  // (of 16, then of 32)
    for (int g = 0; g < 16; ++g) {
      sums[g] = 0;
      for (int i = 0; i < 16; ++i) sums[g] += q[16 * g + i];
    }
    for (int g = 0; g < 8; ++g) sums[16 + g] = sums[2 * g] + sums[2 * g + 1];
    std::memcpy(out + Q8K_SUMS16, sums, sizeof(sums));
  }
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
constexpr int64_t L2_WEIGHTS = 1 << 20;  // (bytes of weight rows a pass holds in L2 while the row tiles pass)
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
  int64_t first = 0;  // (the rows the many-row tiles took)
#if defined(__AVX512VNNI__)
  if ((first = tiled_rows(rows)) > 0)
    f.act_elems == 256 ? run_tiles<KQuantTiles>(kind, act.data(), first, wp, out, nb, yp, ldy, bp)
                       : run_tiles<Tiles32>(kind, act.data(), first, wp, out, nb, yp, ldy, bp);
#endif
  if (first == rows) return;
  at::parallel_for(0, out, 1, [&](int64_t begin, int64_t end) {
    const int64_t wb = std::max<int64_t>(COLS, L2_WEIGHTS / std::max<int64_t>(1, nb * f.bytes) / COLS * COLS);
    for (int64_t o0 = begin; o0 < end; o0 += wb)  // (wb weight rows stay in L2, RT activation rows in L1)
      for (int64_t r = first; r < rows; r += RT) {
        const uint8_t* a[RT];
        float s[std::max(RT, COLS)];
        const int n = static_cast<int>(std::min<int64_t>(RT, rows - r));
        for (int i = 0; i < n; ++i) a[i] = act.data() + (r + i) * nb * f.act_bytes;
        const int64_t stop = std::min(end, o0 + wb), wbytes = nb * f.bytes;
        int64_t o = o0;
        for (; n == 1 && kind != Q6_K && o + COLS <= stop; o += COLS) {  // (decode: COLS rows at once)
          cols_dot(kind, wp + o * wbytes, wbytes, a[0], nb, s);
          for (int c = 0; c < COLS; ++c) yp[r * ldy + o + c] = bp ? s[c] + bp[o + c] : s[c];
        }
        for (; o < stop; ++o) {
          ROWS[n](kind, wp + o * wbytes, a, nb, s);
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
