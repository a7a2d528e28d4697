// Large CPU outputs of the extension, from a small cache of freed blocks.
//
// glibc serves every allocation above 32 MB with a fresh mmap and returns it at free, so each
// training step's 58 MB value gradient met ~14,000 page faults and the kernel's zeroing of every
// page again (as long as the backward's own arithmetic on the project's VM). Blocks freed by torch
// come back here and the next output of a size that fits reuses them, already faulted in and
// advised for transparent huge pages. At most kMaxIdleBytes wait idle; beyond that the oldest are
// returned to the system. torch's CUDA caching allocator does the same for device memory.
#pragma once

// ATen's tensor alone, not torch/extension.h: this file compiled in 22 s with it (the whole torch API and
// pybind11), a few seconds without.
#include <ATen/core/Tensor.h>

namespace smf::cpu {

// at::empty(sizes, options) for a CPU output; blocks of at least kMinPooledBytes come from the cache.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// Returns every idle block to the system; the bytes released.
int64_t release_idle_outputs();

}  // namespace smf::cpu
