// Float32 rows into GGUF blocks (blocks.h), as llama.cpp's reference quantizers (quantize_row_*_ref) compute them: an
// HF checkpoint served with --quantization q8_0 | q4_0 | q4_k, each weight quantized as it loads. Q8_0, Q4_0 and Q5_0
// (q4_k's format for widths off 256, as llama.cpp's) are gguf-py's `quantize` bit for bit; Q4_K (which gguf-py has
// no quantizer for) is llama.cpp's search:
//
// | format | per block                                                                                        |
// |--------|--------------------------------------------------------------------------------------------------|
// | Q8_0   | d = amax / 127 (stored f16), q = roundf(x / d)                                                   |
// | Q4_0   | d = (the x of largest |x|) / -8, q = min(15, trunc(x / d + 8.5)) (d from its float32, stored f16) |
// | Q5_0   | the same with -16, 31 and 16.5                                                                    |
// | Q4_K   | each 32's (scale, min) fitted by weighted least squares over 21 candidate grids (weights          |
// |        | sqrt(mean x^2) + |x|), both 6-bit against the super-block's d, dmin (max / 63, stored f16); q    |
// |        | = nearest((x + dmin m) / (d sc)), clamped to 0..15                                              |
//
// A block holding a NaN or an infinity gets d = NaN (its q 0): every product with it is NaN, as the value was.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "blocks.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

void put_half(uint8_t* p, float v) {
  const uint16_t h = c10::Half(v).x;
  std::memcpy(p, &h, 2);
}

bool finite(const float* x, int n) {
  return std::all_of(x, x + n, [](float v) { return std::isfinite(v); });
}

void q8_0_block(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const bool ok = finite(x, 32);
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(out, ok ? d : NAN);
  for (int i = 0; i < 32; ++i) out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(ok ? std::round(x[i] * id) : 0));
}

template <int Bits>  // (Q4_0: 4; Q5_0: 5, its fifth bits after d)
void q_0_block(const float* x, uint8_t* out) {
  constexpr int half_range = 1 << (Bits - 1), top = (1 << Bits) - 1;
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < 32; ++i)
    if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), max = x[i];
  const bool ok = finite(x, 32);
  const float d = max / -static_cast<float>(half_range), id = d != 0.0f ? 1.0f / d : 0.0f;
  put_half(out, ok ? d : NAN);
  int q[32];
  for (int i = 0; i < 32; ++i) q[i] = ok ? std::min(top, static_cast<int>(std::trunc(x[i] * id + (half_range + 0.5f)))) : 0;
  uint8_t* qs = out + (Bits == 5 ? 6 : 2);
  for (int i = 0; i < 16; ++i) qs[i] = static_cast<uint8_t>((q[i] & 0xF) | (q[16 + i] & 0xF) << 4);
  if (Bits == 5) {
    uint32_t high = 0;
    for (int i = 0; i < 32; ++i) high |= static_cast<uint32_t>(q[i] >> 4) << i;
    std::memcpy(out + 2, &high, 4);
  }
}

// One sub-block's (scale, -min) for levels 0..nmax: llama.cpp's make_qkx2_quants (rmin -1, rdelta 0.1, 20 steps,
// squared error); L gets the levels.
float fit_scale_min(const float* x, const float* w, int n, int nmax, uint8_t* L, float& neg_min) {
  float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]), sum_w += w[i], sum_x += w[i] * x[i];
  lo = std::min(lo, 0.0f);
  if (hi == lo) {
    std::fill(L, L + n, 0);
    neg_min = -lo;
    return 0.0f;
  }
  const auto level = [&](float iscale, float v) {
    return static_cast<uint8_t>(std::clamp(static_cast<int>(std::nearbyint(iscale * (v - lo))), 0, nmax));
  };
  float iscale = nmax / (hi - lo), scale = 1.0f / iscale, best = 0.0f;
  for (int i = 0; i < n; ++i) {
    L[i] = level(iscale, x[i]);
    const float diff = scale * L[i] + lo - x[i];
    best += w[i] * (diff * diff);
  }
  uint8_t aux[32];
  for (int step = 0; step <= 20; ++step) {
    iscale = (-1.0f + 0.1f * step + nmax) / (hi - lo);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      aux[i] = level(iscale, x[i]);
      const float l = aux[i];
      sum_l += w[i] * l, sum_l2 += w[i] * l * l, sum_xl += w[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (!(D > 0.0f)) continue;  // (NaN too)
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0.0f) this_min = 0.0f, this_scale = sum_xl / sum_l2;
    float err = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float diff = this_scale * aux[i] + this_min - x[i];
      err += w[i] * (diff * diff);
    }
    if (err < best) std::copy(aux, aux + n, L), best = err, scale = this_scale, lo = this_min;
  }
  neg_min = -lo;
  return scale;
}

void q4_k_block(const float* x, uint8_t* out) {
  std::memset(out, 0, 144);
  if (!finite(x, 256)) return put_half(out, NAN);
  float scales[8], mins[8], weights[32], max_scale = 0.0f, max_min = 0.0f;
  uint8_t L[256];
  for (int j = 0; j < 8; ++j) {
    const float* xj = x + 32 * j;
    float sum_x2 = 0.0f;
    for (int i = 0; i < 32; ++i) sum_x2 += xj[i] * xj[i];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int i = 0; i < 32; ++i) weights[i] = av_x + std::fabs(xj[i]);
    scales[j] = fit_scale_min(xj, weights, 32, 15, L + 32 * j, mins[j]);
    max_scale = std::max(max_scale, scales[j]), max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f, inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  uint8_t* s = out + 4;
  for (int j = 0; j < 8; ++j) {
    const auto six = [](float v) {  // (as llama.cpp: the nearest integer as a byte, then at most 63)
      return std::min(63, static_cast<int>(static_cast<uint8_t>(static_cast<int>(std::nearbyint(v)))));
    };
    const int ls = six(inv_scale * scales[j]), lm = six(inv_min * mins[j]);
    if (j < 4) {
      s[j] = ls, s[j + 4] = lm;
    } else {
      s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4), s[j - 4] |= (ls >> 4) << 6, s[j] |= (lm >> 4) << 6;
    }
  }
  put_half(out, max_scale / 63.0f), put_half(out + 2, max_min / 63.0f);
  const float d = half(out), dmin = half(out + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min(s, j, sc, m);
    const float ds = d * sc, dm = dmin * m;
    if (ds == 0.0f) continue;  // (its levels stay the fit's)
    for (int i = 0; i < 32; ++i)
      L[32 * j + i] = static_cast<uint8_t>(std::clamp(static_cast<int>(std::nearbyint((x[32 * j + i] + dm) / ds)), 0, 15));
  }
  for (int c = 0; c < 4; ++c)  // (32-byte chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high)
    for (int i = 0; i < 32; ++i) out[16 + 32 * c + i] = L[64 * c + i] | L[64 * c + 32 + i] << 4;
}

at::Tensor quantize_rows(const at::Tensor& x, int64_t kind) {
  TORCH_CHECK(kind == Q8_0 || kind == Q4_0 || kind == Q5_0 || kind == Q4_K, "quantize_rows: no quantizer for block format ",
              kind, " (Q8_0, Q4_0, Q5_0 and Q4_K have one)");
  const Format f = format(kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % f.elems == 0,
              "quantize_rows: float32 [rows, in], in a multiple of ", f.elems);
  const auto block = kind == Q8_0 ? q8_0_block : kind == Q4_0 ? q_0_block<4> : kind == Q5_0 ? q_0_block<5> : q4_k_block;
  auto xc = x.contiguous();
  const int64_t nb = x.size(1) / f.elems;
  auto out = at::empty({x.size(0), nb * f.bytes}, x.options().dtype(at::kByte));
  at::parallel_for(0, x.size(0) * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block(xc.data_ptr<float>() + b * f.elems, out.data_ptr<uint8_t>() + b * f.bytes);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) { m.def("quantize_rows(Tensor x, int kind) -> Tensor"); }

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) { m.impl("quantize_rows", quantize_rows); }
