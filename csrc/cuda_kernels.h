// CUDA kernels of the three ops: plain pointers and launchers, no torch headers
// (so `nvcc -c cuda_kernels.cu` builds on its own). Same arguments and layouts
// as cpu_kernels.h, plus the stream; each launcher returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "dtype.h"

namespace smf::cuda {

cudaError_t topk_forward(DType dtype, const void* query, const void* keys, void* scores, int64_t* indices,
                         int64_t num_tokens, int64_t heads, int64_t key_dim, int64_t n_keys, int64_t topk,
                         cudaStream_t stream);

cudaError_t gather_forward(DType dtype, const void* values, const int64_t* indices, const void* weights,
                           int64_t* counts, const bool* valid, void* out, int64_t num_tokens, int64_t per_token,
                           int64_t dim, cudaStream_t stream);

cudaError_t gather_backward_weights(DType dtype, const void* grad_out, const void* values, const int64_t* indices,
                                    void* grad_weights, int64_t num_tokens, int64_t per_token, int64_t dim,
                                    cudaStream_t stream);

// Bytes of device scratch gather_backward_values needs (reads = N * L < 2**31).
size_t gather_backward_values_workspace_bytes(int64_t num_rows, int64_t out_rows, int64_t reads);

// Deterministic: reads are radix-sorted by output row (stable), then each row is
// summed in read order by the threads that own it. No float atomics.
cudaError_t gather_backward_values(DType dtype, const void* grad_out, const int64_t* indices, const void* weights,
                                   const int64_t* update_rows, int64_t num_update_rows, void* grad, int64_t num_rows,
                                   int64_t num_tokens, int64_t per_token, int64_t dim, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace smf::cuda
