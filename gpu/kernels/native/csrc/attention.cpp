// Paged attention for CPU, float32, batch-invariant: every query token attends over its own keys, read in place
// from the paged cache through its row's block table (no gather into a padded copy).
//
// q [T, Hq, D] holds the step's query tokens, rows after rows (query_start_loc [R + 1]); row r's last query sits at
// position seq_lens[r] - 1, so its token t (of the row's q_len) sees keys 0 .. p with p = seq_lens[r] - q_len + i,
// narrowed to p - window < j (a sliding window, 0: none). The cache is [blocks, block_size, Hkv, D] per tensor;
// key j of row r is at slot block_tables[r, j / block_size] * block_size + j % block_size. Query heads share KV
// heads in groups of Hq / Hkv (one task per token and KV head: its group's heads read each key while in L1).
//
// A token's result depends on nothing but its own query, keys and values: scores s_j = q . k_j (one V16 fma chain
// per lane over D, then simd::sum16's tree) x scale (then softcap x tanh(s / softcap) where softcap > 0), an online
// softmax over chunks of CHUNK keys at fixed absolute positions (multiples of CHUNK), the values summed in key
// order. So a decode row, the same position in a prefill or a chunk, a verification row or a recomputed prompt give
// the same bits alone or in any batch, on any thread count, with the AVX2 or the AVX-512 build. A NaN or +inf score
// (a non-finite key) makes the heads that see it NaN, as torch's softmax does (simd::exp16 keeps NaN); a cache slot
// no query may see is never read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <utility>
#include <limits>
#include <vector>

#include "simd.h"

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif

namespace {

using namespace simd;

constexpr int64_t CHUNK = 16;  // keys per softmax update: one V16 of scores
constexpr int MAX_DV = 16;  // D / 16 rounded up: head dims up to 256
constexpr int64_t MAX_GROUP = 16;  // query heads per KV head

struct Shape {
  int64_t heads, kv_heads, dim, block_size, q_stride_t, q_stride_h, max_blocks;
};

// One token's `group` query heads over keys first .. last (inclusive) of KV head h; out [group][dim]. DV: the head
// dim in V16s, a constant so that a head's accumulators stay in registers.
template <int DV>
void attend(const float* q, const float* k_cache, const float* v_cache, const int64_t* table, int64_t first,
            int64_t last, int64_t h, const Shape& s, float scale, float softcap, float* out) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  V16 qv[MAX_GROUP][DV], acc[MAX_GROUP][DV];
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int64_t g = 0; g < group; ++g) {
    for (int v = 0; v < DV; ++v) qv[g][v] = lanes(q + (h * group + g) * s.q_stride_h, v * 16, dim), acc[g][v] = zero16();
    m[g] = NEG_INF, l[g] = 0.0f;
  }
  for (int64_t c = first - first % CHUNK; c <= last; c += CHUNK) {
    const int64_t j0 = std::max(c, first) - c, j1 = std::min(c + CHUNK, last + 1) - c;  // the chunk's keys c + j
    int64_t rows[CHUNK];  // (the keys' offsets in either cache: one division per chunk, not per key)
    for (int64_t j = j0, b = (c + j0) / s.block_size, o = (c + j0) % s.block_size; j < j1; ++j) {
      rows[j] = ((table[b] * s.block_size + o) * s.kv_heads + h) * dim;
      if (++o == s.block_size) o = 0, ++b;
    }
    for (int64_t g = 0; g < group; ++g) {
      alignas(64) float p[CHUNK];
      for (int64_t j = 0; j < CHUNK; ++j) p[j] = NEG_INF;
      for (int64_t j = j0; j < j1; ++j) {
        V16 dot = zero16();
        for (int v = 0; v < DV; ++v) dot = fma16(qv[g][v], lanes(k_cache + rows[j], v * 16, dim), dot);
        const float x = sum16(dot) * scale;
        p[j] = softcap > 0.0f ? softcap * std::tanh(x / softcap) : x;
      }
      const V16 scores = load16(p);
      const float m_new = std::max(m[g], max16(scores));
      const float alpha = std::exp(m[g] - m_new);  // (0 for the first chunk: m is -inf)
      store16(p, exp16(add16(scores, set16(-m_new))));
      for (int64_t j = 0; j < CHUNK; ++j) p[j] = j >= j0 && j < j1 ? p[j] : 0.0f;
      l[g] = l[g] * alpha + sum16(load16(p)), m[g] = m_new;
      V16 a[DV];
      for (int v = 0; v < DV; ++v) a[v] = mul16(acc[g][v], set16(alpha));
      for (int64_t j = j0; j < j1; ++j) {
        const V16 pj = set16(p[j]);
        for (int v = 0; v < DV; ++v) a[v] = fma16(pj, lanes(v_cache + rows[j], v * 16, dim), a[v]);
      }
      for (int v = 0; v < DV; ++v) acc[g][v] = a[v];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    alignas(64) float buf[DV * 16];
    for (int v = 0; v < DV; ++v) store16(buf + v * 16, mul16(acc[g][v], set16(1.0f / l[g])));
    std::copy(buf, buf + dim, out + g * dim);
  }
}

using AttendFn = decltype(&attend<1>);
template <int... DV>
constexpr std::array<AttendFn, sizeof...(DV)> table_of(std::integer_sequence<int, DV...>) {
  return {attend<DV + 1>...};
}
constexpr auto ATTEND = table_of(std::make_integer_sequence<int, MAX_DV>());  // [DV - 1]

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                           double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "paged_attention: float32 q [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "paged_attention: contiguous float32 caches [blocks, block_size, Hkv, D]");
  const Shape s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), q.stride(0), q.stride(1), block_tables.size(1)};
  TORCH_CHECK(block_tables.dim() == 2 && s.kv_heads > 0 && s.dim > 0, "paged_attention: metadata and head shapes");
  TORCH_CHECK(k_cache.size(3) == s.dim && s.heads % s.kv_heads == 0 && s.heads / s.kv_heads <= MAX_GROUP &&
                  s.dim <= MAX_DV * 16, "paged_attention: head shapes (Hq a multiple of Hkv, at most 16 per KV head; D <= 256)");
  const AttendFn attend_dv = ATTEND[(s.dim + 15) / 16 - 1];
  const int64_t rows = seq_lens.numel(), tokens = q.size(0);
  for (const auto* t : {&query_start_loc, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "paged_attention: contiguous int64 metadata");
  TORCH_CHECK(query_start_loc.numel() == rows + 1 && block_tables.size(0) == rows, "paged_attention: metadata rows");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[rows] == tokens, "paged_attention: query_start_loc spans q's tokens");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> row_of(tokens);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(qsl[r] <= qsl[r + 1] && qsl[r + 1] - qsl[r] <= lens[r] && lens[r] <= s.max_blocks * s.block_size,
                "paged_attention: row ", r, "'s queries, keys and block table disagree");
    for (int64_t b = 0; b * s.block_size < lens[r]; ++b)
      TORCH_CHECK(tables[r * s.max_blocks + b] >= 0 && tables[r * s.max_blocks + b] < k_cache.size(0),
                  "paged_attention: row ", r, "'s block table names a block outside the cache");
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) row_of[t] = r;
  }
  auto out = at::empty({tokens, s.heads, s.dim}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = s.heads / s.kv_heads;
  at::parallel_for(0, tokens * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / s.kv_heads, h = task % s.kv_heads, r = row_of[t];
      const int64_t last = lens[r] - (qsl[r + 1] - t);  // this token's position: it sees keys up to it
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      attend_dv(qp + t * s.q_stride_t, kp, vp, tables + r * s.max_blocks, first, last, h, s, static_cast<float>(scale),
             static_cast<float>(softcap), op + (t * s.heads + h * group) * s.dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(SLUICE_NS, CPU, m) { m.impl("paged_attention", paged_attention); }
