// The block formats' values (blocks.h): rows `ids` of a weight dequantized to float32, as gguf-py's `dequantize`
// computes them, bit for bit (each product one float32 rounding, in its order): a tied or quantized embedding's
// lookup, and the tests' reference point (the other way, values into blocks: quantize.cpp).
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

void dequantize_row(int64_t kind, const uint8_t* w, int64_t blocks, float* y) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (kind == Q8_0) {
      const float d = half(w);
      for (int i = 0; i < 32; ++i) *y++ = static_cast<float>(static_cast<int8_t>(w[2 + i])) * d;
      w += 34;
    } else if (kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q5_1) {
      const bool min = kind == Q4_1 || kind == Q5_1, five = kind == Q5_0 || kind == Q5_1;
      const float d = half(w), m = min ? half(w + 2) : 0.0f;
      const uint8_t* qh = w + (min ? 4 : 2);
      const uint8_t* qs = qh + (five ? 4 : 0);
      uint32_t high = 0;
      if (five) std::memcpy(&high, qh, 4);
      for (int i = 0; i < 32; ++i) {
        const int q = (i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4) | (five ? ((high >> i) & 1) << 4 : 0);
        *y++ = min ? d * static_cast<float>(q) + m : d * static_cast<float>(q - (five ? 16 : 8));
      }
      w += format(kind).bytes;
    } else if (kind == Q4_K || kind == Q5_K) {
      const bool five = kind == Q5_K;
      const float d = half(w), dmin = half(w + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min(w + 4, j, sc, m);
        const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = w[(five ? 48 : 16) + 32 * (j / 2) + i];
          const int high = five ? ((w[16 + i] >> j) & 1) << 4 : 0;
          *y++ = ds * static_cast<float>((j % 2 ? byte >> 4 : byte & 0xF) | high) - dm;
        }
      }
      w += five ? 176 : 144;
    } else {
      const float d = half(w + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, k = i / 32, l = i % 32;
        const uint8_t lo = w[64 * h + l + 32 * (k % 2)];
        const int q = ((k < 2 ? lo & 0xF : lo >> 4) | (((w[128 + 32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
        *y++ = (d * static_cast<float>(static_cast<int8_t>(w[192 + e / 16]))) * static_cast<float>(q);
      }
      w += 210;
    }
  }
}

at::Tensor block_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t kind, int64_t in_features) {
  const Format f = format(kind);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  in_features % f.elems == 0 && blocks.size(1) == in_features / f.elems * f.bytes,
              "block_rows: uint8 [out, row bytes] blocks of in_features columns");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "block_rows: int64 ids");
  auto flat = ids.contiguous().view(-1);
  const int64_t n = flat.numel(), out = blocks.size(0);
  const int64_t* ip = flat.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(ip, ip + n, [&](int64_t i) { return 0 <= i && i < out; }), "block_rows: an id outside 0 .. ", out - 1);
  auto rows = at::empty({n, in_features}, blocks.options().dtype(at::kFloat));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      dequantize_row(kind, blocks.data_ptr<uint8_t>() + ip[r] * blocks.size(1), in_features / f.elems,
                     rows.data_ptr<float>() + r * in_features);
  });
  auto shape = ids.sizes().vec();
  shape.push_back(in_features);
  return rows.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("block_rows(Tensor blocks, Tensor ids, int kind, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("block_rows", block_rows);
}
