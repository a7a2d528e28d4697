// CUDA kernels (see cuda_kernels.h). Plain pointers and launchers; the only
// library used is CUB (shipped with the CUDA toolkit) for the stable radix sort.
#include <cuda_bf16.h>

#include <cub/device/device_radix_sort.cuh>

#include "cuda_kernels.h"

namespace smf::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kBlock = 256;      // threads per block of the gather kernels
constexpr int kTopkBlock = 128;  // threads per (token, head) of the top-k kernel

template <typename T>
struct Accumulate {
  using type = float;
};
template <>
struct Accumulate<double> {
  using type = double;
};

__device__ inline float load(float x) { return x; }
__device__ inline double load(double x) { return x; }
__device__ inline float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline void store(float value, float* out) { *out = value; }
__device__ inline void store(double value, double* out) { *out = value; }
__device__ inline void store(float value, __nv_bfloat16* out) { *out = __float2bfloat16_rn(value); }

// The ranking of reference.ranked_topk (torch.topk's order made total): NaN above
// +inf above every finite value above -inf; equal values (NaNs included) by the
// lower index. True when (v, i) ranks before (w, j).
template <typename A>
__device__ inline bool before(A v, long long i, A w, long long j) {
  const bool v_nan = isnan(v), w_nan = isnan(w);
  if (v_nan || w_nan) return v_nan && (!w_nan || i < j);
  return v > w || (v == w && i < j);
}

// Every lane ends with the first entry of the warp in that order; index -1 = no entry.
template <typename A>
__device__ inline void warp_first(A& value, long long& index) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const A other_value = __shfl_xor_sync(0xffffffffu, value, offset);
    const long long other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (other_index >= 0 && (index < 0 || before(other_value, other_index, value, index))) {
      value = other_value;
      index = other_index;
    }
  }
}

// One round of a warp's k-round selection over entries e in [0, count) with values value(e):
// (previous, previous_index) becomes the first entry ranked after it. Start from
// (NaN, -1), which ranks before every entry. In a total order the next entry always
// exists while rounds <= count, so the index never stays -1.
template <typename A, typename Value>
__device__ inline void next_ranked(Value value, long long count, int lane, A& previous, long long& previous_index) {
  A best = 0;
  long long best_index = -1;
  for (long long e = lane; e < count; e += kWarp) {
    const A v = value(e);
    if (before(previous, previous_index, v, e) && (best_index < 0 || before(v, e, best, best_index))) {
      best = v;
      best_index = e;
    }
  }
  warp_first(best, best_index);
  previous = best;
  previous_index = best_index;
}

template <typename A>
__device__ inline A warp_sum(A value) {  // same tree on every run: deterministic
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// One block per (token, head): sub-key scores (a warp per sub-key), the top-k of
// each half (warps 0 and 1, k rounds of a warp arg-max), then k rounds over the
// k x k pair sums (warp 0), all under the ranking of reference.ranked_topk.
template <typename T>
__global__ void topk_kernel(const T* query, const T* keys, typename Accumulate<T>::type* scores, int64_t* indices,
                            int64_t heads, int64_t key_dim, int64_t n_keys, int64_t topk) {
  using A = typename Accumulate<T>::type;
  extern __shared__ __align__(16) unsigned char shared[];
  long long* top_index = reinterpret_cast<long long*>(shared);  // (2, topk)
  A* q = reinterpret_cast<A*>(top_index + 2 * topk);             // (key_dim,)
  A* s = q + key_dim;                                             // (2, n_keys)
  A* top = s + 2 * n_keys;                                        // (2, topk)
  const int64_t nh = blockIdx.x, h = nh % heads, half = key_dim / 2;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;

  for (int64_t d = threadIdx.x; d < key_dim; d += blockDim.x) q[d] = load(query[nh * key_dim + d]);
  __syncthreads();
  for (int64_t row = warp; row < 2 * n_keys; row += warps) {
    const int64_t c = row / n_keys, j = row % n_keys;
    const T* key = keys + ((h * 2 + c) * n_keys + j) * half;
    A sum = 0;
    for (int64_t d = lane; d < half; d += kWarp) sum += q[c * half + d] * load(key[d]);
    sum = warp_sum(sum);
    if (lane == 0) s[row] = sum;
  }
  __syncthreads();
  if (warp < 2) {  // round r takes the first entry after round r-1's
    const A* half_scores = s + warp * n_keys;
    A previous = NAN;
    long long previous_index = -1;
    for (int64_t r = 0; r < topk; ++r) {
      next_ranked([&](long long j) { return half_scores[j]; }, n_keys, lane, previous, previous_index);
      if (lane == 0) {
        top[warp * topk + r] = previous;
        top_index[warp * topk + r] = previous_index;
      }
    }
  }
  __syncthreads();
  // The k x k pair sums, candidate c = ia * topk + ib as in the reference, ranked the same way.
  // All pairs, not a frontier merge: +inf meeting -inf makes NaN where a row's sums are not monotone.
  if (warp == 0) {
    A previous = NAN;
    long long previous_index = -1;
    for (int64_t r = 0; r < topk; ++r) {
      next_ranked([&](long long c) { return top[c / topk] + top[topk + c % topk]; }, topk * topk, lane, previous,
                  previous_index);
      if (lane == 0) {
        scores[nh * topk + r] = previous;
        indices[nh * topk + r] = top_index[previous_index / topk] * n_keys + top_index[topk + previous_index % topk];
      }
    }
  }
}

// grid (N, D tiles): one thread per (token, column); block column 0 also counts.
template <typename T>
__global__ void gather_forward_kernel(const T* values, const int64_t* indices,
                                      const typename Accumulate<T>::type* weights, int64_t* counts, const bool* valid,
                                      T* out, int64_t per_token, int64_t dim) {
  using A = typename Accumulate<T>::type;
  const int64_t n = blockIdx.x, d = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (d < dim) {
    A sum = 0;
    for (int64_t l = 0; l < per_token; ++l)
      sum += weights[n * per_token + l] * load(values[indices[n * per_token + l] * dim + d]);
    store(sum, out + n * dim + d);
  }
  if (counts != nullptr && blockIdx.y == 0 && (valid == nullptr || valid[n])) {
    for (int64_t l = threadIdx.x; l < per_token; l += blockDim.x)  // integer atomics: exact
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + indices[n * per_token + l]), 1ull);
  }
}

// One block per token, a warp per read: grad_weights[n, l] = <grad_out[n], values[indices[n, l]]>.
template <typename T>
__global__ void gather_backward_weights_kernel(const T* grad_out, const T* values, const int64_t* indices,
                                               typename Accumulate<T>::type* grad_weights, int64_t per_token,
                                               int64_t dim) {
  using A = typename Accumulate<T>::type;
  const int64_t n = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  for (int64_t l = warp; l < per_token; l += warps) {
    const T* row = values + indices[n * per_token + l] * dim;
    A dot = 0;
    for (int64_t d = lane; d < dim; d += kWarp) dot += load(grad_out[n * dim + d]) * load(row[d]);
    dot = warp_sum(dot);
    if (lane == 0) grad_weights[n * per_token + l] = dot;
  }
}

__global__ void fill_kernel(int* out, int value, int64_t size) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < size) out[i] = value;
}

__global__ void row_slot_kernel(const int64_t* update_rows, int* row_slot, int64_t num_update_rows) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < num_update_rows) row_slot[update_rows[t]] = static_cast<int>(t);
}

// Sort key of each read: its output row, or out_rows (sorted last, dropped) for
// rows outside update_rows. The value is the read's position n * L + l.
__global__ void read_keys_kernel(const int64_t* indices, const int* row_slot, int* keys, int* reads, int64_t num_reads,
                                 int out_rows) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= num_reads) return;
  const int row = row_slot == nullptr ? static_cast<int>(indices[e]) : row_slot[indices[e]];
  keys[e] = row < 0 ? out_rows : row;
  reads[e] = static_cast<int>(e);
}

// [begin[r], end[r]) = the sorted positions holding row r (begin = end = 0 if none).
__global__ void row_bounds_kernel(const int* sorted_keys, int* begin, int* end, int64_t num_reads, int out_rows) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= num_reads) return;
  const int key = sorted_keys[p];
  if (key >= out_rows) return;
  if (p == 0 || sorted_keys[p - 1] != key) begin[key] = static_cast<int>(p);
  if (p == num_reads - 1 || sorted_keys[p + 1] != key) end[key] = static_cast<int>(p + 1);
}

// grid (rows, D tiles): each (row, column) summed by one thread over its reads in order.
template <typename T>
__global__ void row_sum_kernel(const T* grad_out, const typename Accumulate<T>::type* weights, const int* sorted_reads,
                               const int* begin, const int* end, typename Accumulate<T>::type* grad, int64_t per_token,
                               int64_t dim) {
  using A = typename Accumulate<T>::type;
  const int64_t r = blockIdx.x, d = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  A sum = 0;
  for (int p = begin[r]; p < end[r]; ++p) {
    const int64_t read = sorted_reads[p];
    sum += weights[read] * load(grad_out[(read / per_token) * dim + d]);
  }
  grad[r * dim + d] = sum;
}

unsigned blocks(int64_t items, int64_t per_block) { return static_cast<unsigned>((items + per_block - 1) / per_block); }

size_t align(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Byte offsets of the backward's scratch arrays, then CUB's temporary storage.
struct Workspace {
  size_t keys, sorted_keys, reads, sorted_reads, begin, end, row_slot, sort_temp, sort_temp_bytes, total;
  Workspace(int64_t num_rows, int64_t out_rows, int64_t num_reads) {
    const size_t read_bytes = align(num_reads * sizeof(int)), row_bytes = align(out_rows * sizeof(int));
    keys = 0;
    sorted_keys = keys + read_bytes;
    reads = sorted_keys + read_bytes;
    sorted_reads = reads + read_bytes;
    begin = sorted_reads + read_bytes;
    end = begin + row_bytes;
    row_slot = end + row_bytes;
    sort_temp = row_slot + align(num_rows * sizeof(int));
    sort_temp_bytes = 0;
    cub::DeviceRadixSort::SortPairs<int, int>(nullptr, sort_temp_bytes, nullptr, nullptr, nullptr, nullptr,
                                              static_cast<int>(num_reads));
    total = sort_temp + align(sort_temp_bytes);
  }
};

template <typename T>
cudaError_t topk_forward_impl(const void* query, const void* keys, void* scores, int64_t* indices, int64_t num_tokens,
                              int64_t heads, int64_t key_dim, int64_t n_keys, int64_t topk, cudaStream_t stream) {
  using A = typename Accumulate<T>::type;
  if (num_tokens * heads == 0) return cudaSuccess;
  const size_t shared = 2 * topk * sizeof(long long) + (key_dim + 2 * n_keys + 2 * topk) * sizeof(A);
  cudaError_t status = cudaFuncSetAttribute(topk_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(shared));
  if (status != cudaSuccess) return status;
  topk_kernel<T><<<static_cast<unsigned>(num_tokens * heads), kTopkBlock, shared, stream>>>(
      static_cast<const T*>(query), static_cast<const T*>(keys), static_cast<A*>(scores), indices, heads, key_dim,
      n_keys, topk);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gather_forward_impl(const void* values, const int64_t* indices, const void* weights, int64_t* counts,
                                const bool* valid, void* out, int64_t num_tokens, int64_t per_token, int64_t dim,
                                cudaStream_t stream) {
  using A = typename Accumulate<T>::type;
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(num_tokens), dim > 0 ? blocks(dim, kBlock) : 1);
  gather_forward_kernel<T><<<grid, kBlock, 0, stream>>>(static_cast<const T*>(values), indices,
                                                        static_cast<const A*>(weights), counts, valid,
                                                        static_cast<T*>(out), per_token, dim);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gather_backward_weights_impl(const void* grad_out, const void* values, const int64_t* indices,
                                         void* grad_weights, int64_t num_tokens, int64_t per_token, int64_t dim,
                                         cudaStream_t stream) {
  using A = typename Accumulate<T>::type;
  if (num_tokens * per_token == 0) return cudaSuccess;
  gather_backward_weights_kernel<T><<<static_cast<unsigned>(num_tokens), kBlock, 0, stream>>>(
      static_cast<const T*>(grad_out), static_cast<const T*>(values), indices, static_cast<A*>(grad_weights),
      per_token, dim);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gather_backward_values_impl(const void* grad_out, const int64_t* indices, const void* weights,
                                        const int64_t* update_rows, int64_t num_update_rows, void* grad,
                                        int64_t num_rows, int64_t num_tokens, int64_t per_token, int64_t dim,
                                        void* workspace, cudaStream_t stream) {
  using A = typename Accumulate<T>::type;
  const int64_t out_rows = update_rows != nullptr ? num_update_rows : num_rows, num_reads = num_tokens * per_token;
  if (out_rows * dim == 0) return cudaSuccess;
  cudaError_t status = cudaMemsetAsync(grad, 0, out_rows * dim * sizeof(A), stream);
  if (status != cudaSuccess || num_reads == 0) return status;
  const Workspace layout(num_rows, out_rows, num_reads);
  char* base = static_cast<char*>(workspace);
  int* keys = reinterpret_cast<int*>(base + layout.keys);
  int* sorted_keys = reinterpret_cast<int*>(base + layout.sorted_keys);
  int* reads = reinterpret_cast<int*>(base + layout.reads);
  int* sorted_reads = reinterpret_cast<int*>(base + layout.sorted_reads);
  int* begin = reinterpret_cast<int*>(base + layout.begin);
  int* end = reinterpret_cast<int*>(base + layout.end);
  int* row_slot = nullptr;
  if (update_rows != nullptr) {
    row_slot = reinterpret_cast<int*>(base + layout.row_slot);
    fill_kernel<<<blocks(num_rows, kBlock), kBlock, 0, stream>>>(row_slot, -1, num_rows);
    if (num_update_rows > 0)
      row_slot_kernel<<<blocks(num_update_rows, kBlock), kBlock, 0, stream>>>(update_rows, row_slot, num_update_rows);
  }
  read_keys_kernel<<<blocks(num_reads, kBlock), kBlock, 0, stream>>>(indices, row_slot, keys, reads, num_reads,
                                                                    static_cast<int>(out_rows));
  int end_bit = 1;
  while ((int64_t(1) << end_bit) <= out_rows) ++end_bit;
  size_t sort_temp_bytes = layout.sort_temp_bytes;
  status = cub::DeviceRadixSort::SortPairs(base + layout.sort_temp, sort_temp_bytes, keys, sorted_keys, reads,
                                           sorted_reads, static_cast<int>(num_reads), 0, end_bit, stream);
  if (status != cudaSuccess) return status;
  status = cudaMemsetAsync(begin, 0, 2 * (layout.end - layout.begin), stream);  // begin and end
  if (status != cudaSuccess) return status;
  row_bounds_kernel<<<blocks(num_reads, kBlock), kBlock, 0, stream>>>(sorted_keys, begin, end, num_reads,
                                                                     static_cast<int>(out_rows));
  const dim3 grid(static_cast<unsigned>(out_rows), blocks(dim, kBlock));
  row_sum_kernel<T><<<grid, kBlock, 0, stream>>>(static_cast<const T*>(grad_out), static_cast<const A*>(weights),
                                                 sorted_reads, begin, end, static_cast<A*>(grad), per_token, dim);
  return cudaGetLastError();
}

}  // namespace

#define SMF_CUDA_DISPATCH(dtype, ...)                \
  switch (dtype) {                                   \
    case DType::Float32: {                           \
      using T = float;                               \
      return __VA_ARGS__;                            \
    }                                                \
    case DType::Float64: {                           \
      using T = double;                              \
      return __VA_ARGS__;                            \
    }                                                \
    case DType::BFloat16: {                          \
      using T = __nv_bfloat16;                       \
      return __VA_ARGS__;                            \
    }                                                \
  }                                                  \
  return cudaErrorInvalidValue

cudaError_t topk_forward(DType dtype, const void* query, const void* keys, void* scores, int64_t* indices,
                         int64_t num_tokens, int64_t heads, int64_t key_dim, int64_t n_keys, int64_t topk,
                         cudaStream_t stream) {
  SMF_CUDA_DISPATCH(dtype, topk_forward_impl<T>(query, keys, scores, indices, num_tokens, heads, key_dim, n_keys,
                                                topk, stream));
}

cudaError_t gather_forward(DType dtype, const void* values, const int64_t* indices, const void* weights,
                           int64_t* counts, const bool* valid, void* out, int64_t num_tokens, int64_t per_token,
                           int64_t dim, cudaStream_t stream) {
  SMF_CUDA_DISPATCH(dtype, gather_forward_impl<T>(values, indices, weights, counts, valid, out, num_tokens, per_token,
                                                  dim, stream));
}

cudaError_t gather_backward_weights(DType dtype, const void* grad_out, const void* values, const int64_t* indices,
                                    void* grad_weights, int64_t num_tokens, int64_t per_token, int64_t dim,
                                    cudaStream_t stream) {
  SMF_CUDA_DISPATCH(dtype, gather_backward_weights_impl<T>(grad_out, values, indices, grad_weights, num_tokens,
                                                           per_token, dim, stream));
}

size_t gather_backward_values_workspace_bytes(int64_t num_rows, int64_t out_rows, int64_t reads) {
  return Workspace(num_rows, out_rows, reads).total;
}

cudaError_t gather_backward_values(DType dtype, const void* grad_out, const int64_t* indices, const void* weights,
                                   const int64_t* update_rows, int64_t num_update_rows, void* grad, int64_t num_rows,
                                   int64_t num_tokens, int64_t per_token, int64_t dim, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream) {
  if (workspace_bytes < gather_backward_values_workspace_bytes(
                            num_rows, update_rows != nullptr ? num_update_rows : num_rows, num_tokens * per_token))
    return cudaErrorInvalidValue;
  SMF_CUDA_DISPATCH(dtype, gather_backward_values_impl<T>(grad_out, indices, weights, update_rows, num_update_rows,
                                                          grad, num_rows, num_tokens, per_token, dim, workspace,
                                                          stream));
}

}  // namespace smf::cuda
