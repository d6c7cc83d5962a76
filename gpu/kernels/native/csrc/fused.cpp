// The decoder's small steps for CPU, float32, one op each (the native kernel set, gpu/kernels/reference.py): what
// torch runs as five to ten ops of a few microseconds of dispatch each, over vectors of a few hundred floats.
//
// - add_rms_norm(x, residual?, weight, eps, offset): s = x + residual (written into residual), then
//   s * r * (weight + offset) with r = 1 / sqrt(mean(s^2) + eps): HF's RMSNorm in float32 (Llama's offset 0, Gemma's
//   1). x is [rows, n] or [A, B, n] (per-head q/k norms), the last dim contiguous.
// - rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots): q and k rotated over their first R dims (R =
//   cos's last dim, the half-split rotation with the sign-folded sin of gpu/layers/rotary.py: x cos + swap(x) sin,
//   each product rounded, then the sum, as torch's mul and addcmul round), q in place; k and v stored at their slots
//   of the paged caches [blocks, block_size, Hkv, D].
// - act_and_mul(x, act): act(gate) * up of x = [gate | up]: silu(g) = g sigmoid(g), tanh-GELU(g) = g sigmoid(2u)
//   (0.5 (1 + tanh u) = sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)), the sigmoid by simd::sigmoid16.
//
// Each output row is computed alone in one fixed order (a row's squares summed lane by lane in V16s, then
// simd::sum16's tree), so it is the same bits in any batch, on any thread count, with either ISA's build. Rows are
// split over the threads only where a step has many (a decode row's few hundred floats run on the caller's thread).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using namespace simd;

constexpr int64_t GRAIN = 1 << 15;  // floats of work below which a step runs on one thread

inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, per_row)); }

// Rows of a [rows, n] or [A, B, n] tensor: row i at (i / B) * s0 + (i % B) * s1.
struct Rows {
  float* p;
  int64_t b, s0, s1;
  explicit Rows(const at::Tensor& t)
      : p(t.data_ptr<float>()), b(t.dim() == 3 ? t.size(1) : 1), s0(t.stride(0)), s1(t.dim() == 3 ? t.stride(1) : 0) {}
  float* operator[](int64_t i) const { return p + (i / b) * s0 + (i % b) * s1; }
};

template <class F>
inline void for_lanes(int64_t n, F f) {  // f(d, lanes) over d = 0, 16, ... < n
  for (int64_t d = 0; d < n; d += 16) f(d, static_cast<int>(std::min<int64_t>(16, n - d)));
}

inline V16 load(const float* p, int n) { return n == 16 ? load16(p) : load16(p, n); }
inline void store(float* p, V16 a, int n) { n == 16 ? store16(p, a) : store16(p, a, n); }

at::Tensor add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps, double offset) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.scalar_type() == at::kFloat && x.stride(-1) == 1,
              "add_rms_norm: float32 x [rows, n] or [A, B, n], the last dim contiguous");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == n && weight.is_contiguous(),
              "add_rms_norm: float32 weight of n elements");
  TORCH_CHECK(!residual || (residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat &&
                            residual->stride(-1) == 1), "add_rms_norm: residual shaped as x");
  auto out = at::empty(x.sizes(), x.options());
  const Rows xs(x), os(out), rs(residual ? *residual : x);
  const float* w = weight.data_ptr<float>();
  const V16 off = set16(static_cast<float>(offset));
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = xs[i];
      if (residual) {  // (the sum first, into residual: the row's norm reads it back from L1)
        float* res = rs[i];
        for_lanes(n, [&](int64_t d, int m) { store(res + d, add16(load(src + d, m), load(res + d, m)), m); });
        src = res;
      }
      V16 squares = zero16();
      for_lanes(n, [&](int64_t d, int m) {
        const V16 s = load(src + d, m);
        squares = fma16(s, s, squares);
      });
      const V16 r = set16(1.0f / std::sqrt(sum16(squares) / static_cast<float>(n) + static_cast<float>(eps)));
      float* dst = os[i];
      for_lanes(n, [&](int64_t d, int m) {
        store(dst + d, mul16(mul16(load(src + d, m), r), add16(load(w + d, m), off)), m);
      });
    }
  });
  return out;
}

// One head's first R dims rotated from src to dst (which may be src): both halves read before either is written.
inline void rotate(const float* src, float* dst, const float* cos, const float* sin, int64_t half) {
  for_lanes(half, [&](int64_t d, int m) {
    const V16 x1 = load(src + d, m), x2 = load(src + half + d, m);
    const V16 y1 = add16(mul16(x1, load(cos + d, m)), mul16(x2, load(sin + d, m)));
    const V16 y2 = add16(mul16(x2, load(cos + half + d, m)), mul16(x1, load(sin + half + d, m)));
    store(dst + d, y1, m), store(dst + half + d, y2, m);
  });
}

void rope_and_write_kv(at::Tensor q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->stride(2) == 1,
                "rope_and_write_kv: float32 q, k, v [T, heads, D], the last dim contiguous");
  const int64_t tokens = q.size(0), dim = q.size(2), kv_heads = k.size(1), rot = cos.size(-1);
  TORCH_CHECK(k.size(0) == tokens && v.sizes() == k.sizes() && k.size(2) == dim, "rope_and_write_kv: q, k, v shapes");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && k_cache.size(2) == kv_heads && k_cache.size(3) == dim,
              "rope_and_write_kv: contiguous float32 caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == tokens * rot && rot % 2 == 0 && rot <= dim &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "rope_and_write_kv: float32 cos, sin [T, (1,) R], R even, R <= D");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "rope_and_write_kv: int64 slots, one a token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "rope_and_write_kv: slot ", slot[t], " outside the cache");
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const Rows qs(q), ks(k), vs(v);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t heads = q.size(1), half = rot / 2;
  at::parallel_for(0, tokens, grain((heads + 2 * kv_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * rot, *s = sp + t * rot;
      for (int64_t h = 0; h < heads; ++h) rotate(qs[t * heads + h], qs[t * heads + h], c, s, half);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float *kh = ks[t * kv_heads + h], *vh = vs[t * kv_heads + h];
        float *kd = kc + (slot[t] * kv_heads + h) * dim, *vd = vc + (slot[t] * kv_heads + h) * dim;
        rotate(kh, kd, c, s, half);
        std::copy(kh + rot, kh + dim, kd + rot);
        std::copy(vh, vh + dim, vd);
      }
    }
  });
}

at::Tensor act_and_mul(const at::Tensor& x, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "act_and_mul: float32 x [rows, 2 d], the last dim contiguous");
  TORCH_CHECK(act == 0 || act == 1, "act_and_mul: act 0 (silu) or 1 (tanh GELU)");
  const int64_t rows = x.size(0), d = x.size(1) / 2, ld = x.stride(0);
  auto out = at::empty({rows, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = xp + r * ld, *up = gate + d;
      for_lanes(d, [&](int64_t i, int m) {
        const V16 g = load(gate + i, m);
        const V16 z = act == 0 ? g
                               : mul16(set16(1.5957691216057308f),  // 2 sqrt(2 / pi)
                                       fma16(mul16(set16(0.044715f), mul16(g, g)), g, g));
        store(op + r * d + i, mul16(mul16(g, sigmoid16(z)), load(up + i, m)), m);
      });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, float offset) -> Tensor");
  m.def("rope_and_write_kv(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots) -> ()");
  m.def("act_and_mul(Tensor x, int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_and_write_kv", rope_and_write_kv);
  m.impl("act_and_mul", act_and_mul);
}
