// Memory the kernels stream weights from: aligned to 2 MB and advised for transparent huge pages where a tensor spans
// one, so that reading a step's weights once misses the TLB every 2 MB instead of every 4 KB (measured in
// docs/PERFORMANCE.md; advice only: where the system's THP setting is "never" they are ordinary pages).
#pragma once
#include <ATen/ATen.h>

#include <sys/mman.h>

#include <cstdint>

namespace {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

// A CPU tensor of at least one huge page in a mapping of its own (fresh pages, never touched before the advice,
// unmapped with the tensor), 2 MB-aligned and advised for huge pages; smaller ones are ordinary (uninitialised).
inline at::Tensor huge_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(dtype);
  if (bytes < HUGE_PAGE) return at::empty(sizes, options);
  const size_t mapped = bytes + HUGE_PAGE;  // (room to align the start)
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "out of memory: ", bytes, " bytes of weights");
  auto* p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(base) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
  madvise(p, bytes, MADV_HUGEPAGE);  // (may fail: advice)
  return at::from_blob(p, sizes, [base, mapped](void*) { munmap(base, mapped); }, options);
}

// huge_empty's tensor of zeros: a fresh mapping is the kernel's zero pages already (no pass to write them)
inline at::Tensor huge_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const size_t bytes = c10::multiply_integers(sizes) * c10::elementSize(dtype);
  return bytes < HUGE_PAGE ? at::zeros(sizes, at::TensorOptions().dtype(dtype)) : huge_empty(sizes, dtype);
}

}  // namespace
