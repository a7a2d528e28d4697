// CPU kernels of the three ops: plain pointers, OpenMP over tokens or rows.
//
// Shapes: N tokens, H heads, L = slots per token, D = value width, M = rows.
// "acc" below means float64 when dtype is Float64, float32 otherwise. All
// inputs are contiguous; every kernel is deterministic (no thread-order sums).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace smf::cpu {

// Top-k of the product keys from the sub-key scores sub_scores (H, 2, N, n_keys) acc
// (query half c of token n against sub-key j of head h; a GEMM computes them).
// Writes scores (N, H, topk) acc, sorted descending, and indices (N, H, topk)
// holding slot ids i * n_keys + j. `dtype` is the acc type (Float32 or Float64).
void topk_select(DType dtype, const void* sub_scores, void* scores, int64_t* indices, int64_t num_tokens,
                 int64_t heads, int64_t n_keys, int64_t topk, int threads);

// Whether topk_forward_float computes its scores in vector register tiles on this build:
// AVX-512, or AVX2 with FMA. Without them its scalar scores are slower than at::bmm (MKL)
// followed by topk_select.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kFusedTopkFloat = true;
#else
constexpr bool kFusedTopkFloat = false;
#endif

// The float32 top-k in one pass: for each block of tokens, the sub-key scores are
// computed into a per-thread buffer and selected while still in cache. query
// (N, H, 2 * half) of `dtype` (Float32 or BFloat16, whose rows are converted to fp32
// a block at a time); keys_t (H, 2, padded_keys / 16, half, 16) fp32, the sub-keys
// zero-padded to padded_keys (a multiple of 16) and transposed in panels of 16: entry
// [h, c, p, d, l] is component d of sub-key 16 p + l. Writes scores and indices as
// topk_select does.
void topk_forward_float(DType dtype, const void* query, const float* keys_t, float* scores, int64_t* indices,
                        int64_t num_tokens, int64_t heads, int64_t half, int64_t n_keys, int64_t padded_keys,
                        int64_t topk, int threads);

// out (N, D) = sum_l weights[n, l] * values[indices[n, l]]; values (M, D) and out
// of `dtype`, weights (N, L) acc. If counts (M,) is not null, counts[indices[n, l]]
// += 1 for every token with valid == nullptr or valid[n]; M = num_rows.
void gather_forward(DType dtype, const void* values, const int64_t* indices, const void* weights,
                    int64_t* counts, const bool* valid, void* out, int64_t num_rows, int64_t num_tokens,
                    int64_t per_token, int64_t dim, int threads);

// grad_weights (N, L) acc = <grad_out[n], values[indices[n, l]]>; grad_out (N, D)
// and values (M, D) of `dtype`.
void gather_backward_weights(DType dtype, const void* grad_out, const void* values, const int64_t* indices,
                             void* grad_weights, int64_t num_tokens, int64_t per_token, int64_t dim, int threads);

// grad (R, D) acc: row r = sum over reads (n, l) of row target(r) of weights[n, l] * grad_out[n].
// Dense (update_rows == nullptr): R = num_rows and target(r) = r. Sparse: R = num_update_rows,
// target(r) = update_rows[r] (distinct), reads of other rows are dropped.
// grad_out (N, D) of `dtype`, weights (N, L) acc. Each row is summed in token order.
void gather_backward_values(DType dtype, const void* grad_out, const int64_t* indices, const void* weights,
                            const int64_t* update_rows, int64_t num_update_rows, void* grad, int64_t num_rows,
                            int64_t num_tokens, int64_t per_token, int64_t dim, int threads);

// Both gradients of the gather in one pass over the reads grouped by table row (by output row
// when only a sparse grad_values is asked for: nothing the size of the table is made):
// grad_weights (N, L) acc as gather_backward_weights, grad_values (R, D) acc as
// gather_backward_values; either output may be null (not computed). Each row's reads
// are summed in token order and each weight gradient is one dot product, so the
// results do not depend on the thread count.
void gather_backward(DType dtype, const void* grad_out, const void* values, const int64_t* indices,
                     const void* weights, const int64_t* update_rows, int64_t num_update_rows, void* grad_values,
                     void* grad_weights, int64_t num_rows, int64_t num_tokens, int64_t per_token, int64_t dim,
                     int threads);

// Backward of the product-key top-k: grad_query (N, H, 2 * half) acc and grad_keys
// (H, 2, n_keys, half) acc from grad_scores (N, H, topk) acc, reading only the sub-keys
// of the chosen slots (indices (N, H, topk), slot = i * n_keys + j); query and keys of
// `dtype`. Either output may be null (not computed). Thread-count independent.
void topk_backward(DType dtype, const void* grad_scores, const void* query, const void* keys, const int64_t* indices,
                   void* grad_query, void* grad_keys, int64_t num_tokens, int64_t heads, int64_t half, int64_t n_keys,
                   int64_t topk, int threads);

// out = silu(gate) * read elementwise, silu(x) = x * sigmoid(x); n values each, all of `dtype`
// (computed in acc, rounded once).
void silu_mul_forward(DType dtype, const void* gate, const void* read, void* out, int64_t n, int threads);

// Its backward from grad: grad_read = grad * silu(gate) and grad_gate = grad * read * sigmoid(gate)
// * (1 + gate * (1 - sigmoid(gate))); n values each, all of `dtype`.
void silu_mul_backward(DType dtype, const void* grad, const void* gate, const void* read, void* grad_gate,
                       void* grad_read, int64_t n, int threads);

// AdamW on rows `rows` (T,) of param (M, D) `dtype` in place, with its moments exp_avg and exp_avg_sq
// (M, D) `dtype` and per-row step counts row_step (M,): row t of grad (T, D) acc, times grad_scale, is
// row rows[t]'s gradient; rows with valid != nullptr && !valid[t] are skipped. Rows are distinct. With
// slots != nullptr (T,) distinct, row rows[t]'s moments and step count are row slots[t] of (S, D) / (S,) state.
void row_adamw(DType dtype, void* param, void* exp_avg, void* exp_avg_sq, int64_t* row_step, const int64_t* rows,
               const int64_t* slots, const void* grad, const bool* valid, int64_t num_update_rows, int64_t dim, double lr, double grad_scale,
               double beta1, double beta2, double eps, double weight_decay, int threads);

}  // namespace smf::cpu
