// LoRA deltas for CPU, float32 activations, batch-invariant (gpu/layers/lora.py holds the slot tables and calls this):
//
//   y[t, :] += B[s] · (A[s] · x[t])   for every token t whose slot s = slots[t] is >= 0 (-1: the base model's)
//
// A: [S, P r, in], stacked part p's A in rows p r .. p r + r - 1; B: [S, r, out] (Bᵀ), part p's columns parts[p] ..
// parts[p + 1] - 1 (the scale folded in); a lower-rank adapter's are zero-padded. The tables are float32, bfloat16 or
// float16 (--lora-dtype), widened exactly as they are read: the arithmetic is float32's either way. The shrink's every
// element is `dot`'s fixed order over x, the expand's an fma chain over the ranks in order, 16 columns a vector,
// added to y last: a token's delta is the same bits whatever the tokens around it, the threads or the ISA.
// Tokens are grouped by slot, so an A row or a B tile is read once per group (in cache for its tokens); the shrink
// is split over the threads by (group, A row), the expand by (group, 64 columns of a part).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using namespace simd;

constexpr int64_t TILE = 64;  // columns of an expand work item

struct BF16 {  // a bfloat16 table element (its bits)
  uint16_t bits;
};
struct F16 {  // a float16 one
  uint16_t bits;
};

// 16 table elements as floats (the first n: the rest 0), from float32s or, widened exactly, 16-bit floats.
#if defined(__AVX512F__)
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline V16 load16(const BF16* p) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(p)), 16))}; }
inline V16 load16(const F16* p) { return {_mm512_cvtph_ps(load256(p))}; }
#else
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m256 widen8(const BF16* p) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p)), 16)); }
inline V16 load16(const BF16* p) { return {widen8(p), widen8(p + 8)}; }
inline V16 load16(const F16* p) { return {_mm256_cvtph_ps(load128(p)), _mm256_cvtph_ps(load128(p + 8))}; }
#endif
template <typename H>
inline V16 load16(const H* p, int n) {
  H part[16] = {};
  std::memcpy(part, p, sizeof(H) * n);
  return load16(part);
}

// a · b: four V16 fma chains over the 64-element blocks (independent, so the fma latency is hidden), what is left
// after them in the first, then (c0 + c1) + (c2 + c3) and sum16's tree: one fixed order. (Registers only: no array
// indexed at run time.)
template <typename T>
inline float dot(const T* a, const float* b, int64_t n) {
  V16 c0 = zero16(), c1 = zero16(), c2 = zero16(), c3 = zero16();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    c0 = fma16(load16(a + i), load16(b + i), c0);
    c1 = fma16(load16(a + i + 16), load16(b + i + 16), c1);
    c2 = fma16(load16(a + i + 32), load16(b + i + 32), c2);
    c3 = fma16(load16(a + i + 48), load16(b + i + 48), c3);
  }
  for (; i + 16 <= n; i += 16) c0 = fma16(load16(a + i), load16(b + i), c0);
  if (i < n) c0 = fma16(load16(a + i, static_cast<int>(n - i)), load16(b + i, static_cast<int>(n - i)), c0);
  return sum16(add16(add16(c0, c1), add16(c2, c3)));
}

// y[0 .. 16) (its first n) += Σ_j ranks[j] · bt[j * ld + 0 .. 16) for j = 0 .. r - 1 in order, added to y last.
template <typename T>
inline void expand16(float* y, const float* ranks, const T* bt, int64_t ld, int64_t r, int n) {
  V16 d = zero16();
  for (int64_t j = 0; j < r; ++j) d = fma16(set16(ranks[j]), n == 16 ? load16(bt + j * ld) : load16(bt + j * ld, n), d);
  store16(y, add16(n == 16 ? load16(y) : load16(y, n), d), n);
}

// ... 64 columns at once: four independent chains (the same order per column as expand16's).
template <typename T>
inline void expand64(float* y, const float* ranks, const T* bt, int64_t ld, int64_t r) {
  V16 d0 = zero16(), d1 = zero16(), d2 = zero16(), d3 = zero16();
  for (int64_t j = 0; j < r; ++j) {
    const V16 w = set16(ranks[j]);
    const T* row = bt + j * ld;
    d0 = fma16(w, load16(row), d0);
    d1 = fma16(w, load16(row + 16), d1);
    d2 = fma16(w, load16(row + 32), d2);
    d3 = fma16(w, load16(row + 48), d3);
  }
  store16(y, add16(load16(y), d0));
  store16(y + 16, add16(load16(y + 16), d1));
  store16(y + 32, add16(load16(y + 32), d2));
  store16(y + 48, add16(load16(y + 48), d3));
}

// y[0 .. n) += Σ_j ranks[j] · bt[j * ld + 0 .. n), n <= 64.
template <typename T>
inline void expand(float* y, const float* ranks, const T* bt, int64_t ld, int64_t r, int64_t n) {
  if (n == 64) return expand64(y, ranks, bt, ld, r);
  for (int64_t o = 0; o < n; o += 16)
    expand16(y + o, ranks, bt + o, ld, r, static_cast<int>(std::min<int64_t>(16, n - o)));
}

// The shrink into xa [T, P r], then the expand into y, for the tokens of each slot present (lora_add's groups).
template <typename T>
void deltas(const at::Tensor& x, at::Tensor& y, at::Tensor& xa, const T* ap, const T* bp,
            const std::vector<std::vector<int64_t>>& of_slot, const std::vector<int64_t>& group_slot,
            const std::vector<std::array<int64_t, 3>>& tiles, int64_t r) {
  const int64_t T_ = x.size(0), in = x.size(1), out = y.size(1), PR = xa.size(1);
  const int64_t G = static_cast<int64_t>(group_slot.size());
  const float* xp = x.data_ptr<float>();
  float *xap = xa.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  // (a work item's fmas: grains of at least 1 << 18 of them a thread, else the threads cost more than they save)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) * G / (T_ * std::max<int64_t>(in, r * TILE)));
  at::parallel_for(0, G * PR, grain, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = group_slot[w / PR], j = w % PR;
      const T* row = ap + (s * PR + j) * in;
      for (const int64_t t : of_slot[s]) xap[t * PR + j] = dot(row, xp + t * in, in);
    }
  });
  const int64_t NT = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, G * NT, grain, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = group_slot[w / NT];
      const auto [p, first, last] = tiles[w % NT];
      const T* bt = bp + s * r * out;  // Bᵀ of slot s: [r, out]
      for (const int64_t t : of_slot[s]) expand(yp + t * ldy + first, xap + t * PR + p * r, bt + first, out, r, last - first);
    }
  });
}

void lora_add(const at::Tensor& x_in, at::Tensor y, const at::Tensor& slots, const at::Tensor& a, const at::Tensor& b,
              at::IntArrayRef parts) {
  const auto x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && y.stride(1) == 1,
              "lora_add: x [T, in] and y [T, out] (rows contiguous)");
  const auto table = a.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  (table == at::kFloat || table == at::kBFloat16 || table == at::kHalf) && b.scalar_type() == table &&
                  a.is_contiguous() && b.is_contiguous(),
              "lora_add: float32 x and y, contiguous float32, bfloat16 or float16 tables");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "lora_add: an int64 slot a token");
  const int64_t T = x.size(0), in = x.size(1), out = y.size(1), S = a.size(0), r = b.size(1);
  const int64_t P = static_cast<int64_t>(parts.size()) - 1, PR = a.size(1);
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(2) == in && b.size(0) == S && b.size(2) == out && PR == P * r &&
                  P >= 1 && parts[0] == 0 && parts[P] == out,
              "lora_add: A [S, P r, in], B [S, r, out] and the parts' first columns (0 .. out)");
  std::vector<std::array<int64_t, 3>> tiles;  // (part, first column, end)
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(parts[p] <= parts[p + 1], "lora_add: the parts' first columns in order");
    for (int64_t o = parts[p]; o < parts[p + 1]; o += TILE) tiles.push_back({p, o, std::min(o + TILE, parts[p + 1])});
  }
  std::vector<std::vector<int64_t>> of_slot(S);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] < S, "lora_add: slot ", sp[t], " of token ", t, " is not in the table's ", S);
    if (sp[t] >= 0) of_slot[sp[t]].push_back(t);
  }
  std::vector<int64_t> group_slot;
  for (int64_t s = 0; s < S; ++s)
    if (!of_slot[s].empty()) group_slot.push_back(s);
  if (group_slot.empty()) return;
  auto xa = at::empty({T, PR}, x.options());
  const auto run = [&](const auto* a_elements, const auto* b_elements) {
    deltas(x, y, xa, a_elements, b_elements, of_slot, group_slot, tiles, r);
  };
  if (table == at::kFloat) return run(a.data_ptr<float>(), b.data_ptr<float>());
  if (table == at::kBFloat16) return run(static_cast<const BF16*>(a.data_ptr()), static_cast<const BF16*>(b.data_ptr()));
  run(static_cast<const F16*>(a.data_ptr()), static_cast<const F16*>(b.data_ptr()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("lora_add(Tensor x, Tensor(a!) y, Tensor slots, Tensor a, Tensor b, int[] parts) -> ()");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) { m.impl("lora_add", lora_add); }
