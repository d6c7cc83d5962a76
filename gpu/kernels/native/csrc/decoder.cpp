// A decoder stack's layer loop as one native call (gpu/runner/native_loop.py builds it where a model qualifies): at a
// batch-1 decode step of SmolLM2-135M the Python between the ~8 ops of each of 30 layers cost 5-8 ms of a 15 ms
// (quantized) to 33 ms (float32) step. `Decoder` holds each layer's weights as the native ops take them and calls those same ops,
// through the dispatcher, in the same order and on the same arguments as the Python loop (gpu/models/decoder.py
// with the native backend's kernel set and linear layers: gpu/layers/linear.py), so its results are the same
// bits (tests/test_native_decoder.py). One layer, with the stream residual + h:
//
//   x = rms_norm(h + residual) (the sum into residual; the first layer: residual = h)
//   q, k, v = split(qkv(x)); rotate q, k and write k, v at the step's slots; a = attention(q) over the paged cache
//   x = rms_norm(o(a) + residual); h = down(act(gate) * up) of gate_up(x)
//
// and at the end rms_norm(h + residual) with the final norm's weight. A linear layer runs the native kernel on its
// panels (float32, bfloat16 or float16), bias inside, or, held in GGUF blocks, block_linear_out per stacked part into
// its columns (the part's bias slice inside): the paths gpu/layers/linear.py's Linear takes, at any row count; then,
// where LoRA adapters target it and the step has LoRA tokens, lora_add over its slot tables (gpu/layers/lora.py).
// `layers_done` counts the layers run since it was built (any thread may read it while a forward runs: a process
// worker's heartbeat shows its progress by it, actors/engine/worker.py; the GIL is not held through a forward).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#ifndef SLUICE_NS
#error "SLUICE_NS names the op namespace of this ISA's build"
#endif
#define SLUICE_STR2(x) #x
#define SLUICE_STR(x) SLUICE_STR2(x)

namespace {

using OptT = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {  // this library's op `name`
  const std::string full = std::string(SLUICE_STR(SLUICE_NS)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), "").typed<Sig>();
}

// The native ops' signatures (as registered: linear.cpp, blocks.cpp, fused.cpp, attention.cpp)
using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptT&, int64_t);
using BlocksSig = void(const at::Tensor&, const at::Tensor&, int64_t, const OptT&, at::Tensor);
using NormSig = at::Tensor(const at::Tensor&, const OptT&, const at::Tensor&, double, double);
using RopeSig = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                     at::Tensor, const at::Tensor&);
using ActSig = at::Tensor(const at::Tensor&, int64_t);
using LoraSig = void(const at::Tensor&, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     at::IntArrayRef);
using AttendSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, int64_t, double);

struct Linear {
  OptT panels;  // the native kernel's (pack) ...
  int64_t out;
  OptT bias;
  std::vector<int64_t> firsts, kinds;  // or GGUF blocks: each stacked part's first row and format ...
  std::vector<at::Tensor> blocks;  // ... and its [rows, row bytes] (every row count)
  OptT lora_a, lora_b;  // LoRA's slot tables, where adapters target it, and its stacked parts' first rows
  std::vector<int64_t> lora_parts;
};

struct Layer {
  at::Tensor in_norm, post_norm;
  int64_t q, k, v, head_dim;  // the qkv output's widths, and the heads' width
  double scale;
  int64_t window;  // 0: none
  double softcap;  // 0: none
  int64_t act, rope;  // act_and_mul's activation; which of the step's rotaries
};

struct Decoder : torch::CustomClassHolder {
  std::vector<Linear> linears;  // four a layer: qkv, o, gate_up, down
  std::vector<Layer> layers;
  double eps = 0.0, offset = 0.0;
  at::Tensor final_norm;
  std::atomic<int64_t> done{0};  // layers run (layers_done)
  c10::TypedOperatorHandle<LinearSig> linear_ = op<LinearSig>("linear");
  c10::TypedOperatorHandle<BlocksSig> blocks_ = op<BlocksSig>("block_linear_out");
  c10::TypedOperatorHandle<NormSig> norm_ = op<NormSig>("add_rms_norm");
  c10::TypedOperatorHandle<RopeSig> rope_ = op<RopeSig>("rope_and_write_kv");
  c10::TypedOperatorHandle<ActSig> act_ = op<ActSig>("act_and_mul");
  c10::TypedOperatorHandle<AttendSig> attend_ = op<AttendSig>("paged_attention");
  c10::TypedOperatorHandle<LoraSig> lora_ = op<LoraSig>("lora_add");

  Decoder(at::Tensor final_norm, double eps, double offset) : eps(eps), offset(offset), final_norm(final_norm) {}

  void add_linear(at::Tensor panels, int64_t out, OptT bias) {
    linears.push_back({panels, out, bias, {}, {}, {}, c10::nullopt, c10::nullopt, {}});
  }

  // The last linear added has LoRA slot tables.
  void add_lora(at::Tensor a, at::Tensor b, std::vector<int64_t> parts) {
    TORCH_CHECK(!linears.empty(), "Decoder.add_lora: after its linear");
    linears.back().lora_a = a;
    linears.back().lora_b = b;
    linears.back().lora_parts = parts;
  }

  void add_blocks(std::vector<int64_t> firsts, std::vector<int64_t> kinds, std::vector<at::Tensor> blocks, int64_t out,
                  OptT bias) {
    TORCH_CHECK(!blocks.empty() && firsts.size() == blocks.size() && kinds.size() == blocks.size(),
                "Decoder.add_blocks: a first row and a format for each part's blocks");
    linears.push_back({c10::nullopt, out, bias, firsts, kinds, blocks, c10::nullopt, c10::nullopt, {}});
  }

  // A layer over the last four linears added (qkv, o, gate_up, down).
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, int64_t q, int64_t k, int64_t v, int64_t head_dim,
                 double scale, int64_t window, double softcap, int64_t act, int64_t rope) {
    TORCH_CHECK(linears.size() == 4 * (layers.size() + 1), "Decoder.add_layer: after its four linears");
    layers.push_back({in_norm, post_norm, q, k, v, head_dim, scale, window, softcap, act, rope});
  }

  at::Tensor run(const Linear& l, const at::Tensor& x, const OptT& lora_slots) const {
    const auto flat = x.contiguous();
    at::Tensor y;
    if (!l.blocks.empty()) {
      y = at::empty({flat.size(0), l.out}, flat.options());
      for (size_t i = 0; i < l.blocks.size(); ++i) {
        const int64_t rows = l.blocks[i].size(0);
        const OptT bias = l.bias ? OptT(l.bias->narrow(0, l.firsts[i], rows)) : c10::nullopt;
        blocks_.call(flat, l.blocks[i], l.kinds[i], bias, y.narrow(1, l.firsts[i], rows));
      }
    } else {
      y = linear_.call(flat, *l.panels, l.out, l.bias, 0);  // (act: none)
    }
    if (l.lora_a && lora_slots) lora_.call(flat, y, *lora_slots, *l.lora_a, *l.lora_b, l.lora_parts);
    return y;
  }

  // The final normed hidden states of h (the embedded tokens [T, hidden]); k/v_caches: each layer's, cos/sin: each
  // rotary's for the step's positions; slots, qsl, seq_lens, tables: the attention metadata (every row native);
  // lora_slots: each token's LoRA slot (-1: none), or none in a step without LoRA rows.
  at::Tensor forward(at::Tensor h, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, at::Tensor slots,
                     at::Tensor qsl, at::Tensor seq_lens, at::Tensor tables, OptT lora_slots) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
                "Decoder.forward: a K and a V cache a layer");
    const int64_t n = h.size(0);
    OptT residual;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      const Linear* lin = &linears[4 * i];
      auto x = norm_.call(h, residual, L.in_norm, eps, offset);
      if (!residual) residual = h;
      auto qkv = run(lin[0], x, lora_slots);
      auto q = qkv.narrow(1, 0, L.q).view({n, -1, L.head_dim});
      auto k = qkv.narrow(1, L.q, L.k).view({n, -1, L.head_dim});
      auto v = qkv.narrow(1, L.q + L.k, L.v).view({n, -1, L.head_dim});
      rope_.call(q, k, v, cos.at(L.rope), sin.at(L.rope), k_caches[i], v_caches[i], slots);
      auto a = attend_.call(q, k_caches[i], v_caches[i], qsl, seq_lens, tables, L.scale, L.window, L.softcap);
      x = norm_.call(run(lin[1], a.flatten(1), lora_slots), residual, L.post_norm, eps, offset);
      h = run(lin[3], act_.call(run(lin[2], x, lora_slots), L.act), lora_slots);
      done.fetch_add(1, std::memory_order_relaxed);
    }
    return norm_.call(h, residual, final_norm, eps, offset);
  }

  int64_t layers_done() const { return done.load(std::memory_order_relaxed); }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(SLUICE_NS, m) {
  m.class_<Decoder>("Decoder")
      .def(torch::init<at::Tensor, double, double>())
      .def("add_linear", &Decoder::add_linear)
      .def("add_blocks", &Decoder::add_blocks)
      .def("add_lora", &Decoder::add_lora)
      .def("add_layer", &Decoder::add_layer)
      .def("forward", &Decoder::forward)
      .def("layers_done", &Decoder::layers_done);
}
