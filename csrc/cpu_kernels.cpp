// CPU kernels (see cpu_kernels.h). Each parallel loop gives every thread a
// disjoint set of output rows, so results never depend on scheduling.
#include "cpu_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace smf::cpu {
namespace {

// bfloat16 as raw bits; converted with the same round-to-nearest-even as torch.
struct BFloat16 {
  uint16_t bits;
};

template <typename T>
struct Accumulate {
  using type = float;
};
template <>
struct Accumulate<double> {
  using type = double;
};

inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline float load(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline void store(float value, float* out) { *out = value; }
inline void store(double value, double* out) { *out = value; }
inline void store(float value, BFloat16* out) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
    out->bits = 0x7fc0;
    return;
  }
  out->bits = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Top `k` of s[0..n), sorted descending; on ties the lower index comes first.
// Insertion into a sorted list: the general path.
template <typename A>
void insertion_topk(const A* s, int64_t n, int64_t k, A* top_values, int64_t* top_indices) {
  int64_t filled = 0;
  for (int64_t j = 0; j < n; ++j) {
    const A v = s[j];
    if (filled == k && !(v > top_values[k - 1])) continue;
    int64_t pos = filled < k ? filled++ : k - 1;
    for (; pos > 0 && v > top_values[pos - 1]; --pos) {
      top_values[pos] = top_values[pos - 1];
      top_indices[pos] = top_indices[pos - 1];
    }
    top_values[pos] = v;
    top_indices[pos] = j;
  }
}

// Same result as insertion_topk, faster: the k groups {j : j % k == g} each hold
// an element >= t, the smallest group maximum, so the top k are among the
// candidates s[j] >= t (a few times k for random scores). They are gathered
// without branches, then insertion-sorted. `scratch` holds 2 * n values, `candidates` n.
template <typename A>
void select_topk(const A* s, int64_t n, int64_t k, A* top_values, int64_t* top_indices, A* scratch,
                 int64_t* candidates) {
  A* group_max = scratch;
  A* candidate_values = scratch + n;
  std::copy(s, s + k, group_max);
  for (int64_t j0 = k; j0 < n; j0 += k) {
    const int64_t width = std::min(k, n - j0);
#pragma omp simd
    for (int64_t g = 0; g < width; ++g) group_max[g] = std::max(group_max[g], s[j0 + g]);
  }
  A t = group_max[0];
  for (int64_t g = 1; g < k; ++g) t = std::min(t, group_max[g]);
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    candidates[count] = j;
    candidate_values[count] = s[j];
    count += s[j] >= t;
  }
  if (count < k) {  // NaNs compare false with t
    insertion_topk(s, n, k, top_values, top_indices);
    return;
  }
  insertion_topk(candidate_values, count, k, top_values, top_indices);
  for (int64_t r = 0; r < k; ++r) top_indices[r] = candidates[top_indices[r]];
}

// Top `k` sums a[i] + b[j] of two descending lists of length k, by a frontier
// walk: row i's next candidate is b[next[i]]. next[] never increases with i, so
// rows past the first untouched one are dominated and not scanned.
template <typename A>
void merge_topk(const A* a, const int64_t* a_index, const A* b, const int64_t* b_index, int64_t k, int64_t n_keys,
                int64_t* next, A* scores, int64_t* indices) {
  std::fill(next, next + k, 0);
  for (int64_t r = 0; r < k; ++r) {
    int64_t best = -1;
    A best_score = 0;
    for (int64_t i = 0; i < k; ++i) {
      if (next[i] == k) continue;
      const A score = a[i] + b[next[i]];
      if (best < 0 || score > best_score) {
        best = i;
        best_score = score;
      }
      if (next[i] == 0) break;
    }
    scores[r] = best_score;
    indices[r] = a_index[best] * n_keys + b_index[next[best]];
    ++next[best];
  }
}

template <typename A>
void topk_select_impl(const A* sub_scores, A* scores, int64_t* indices, int64_t num_tokens, int64_t heads,
                      int64_t n_keys, int64_t topk, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<A> top(2 * topk), scratch(2 * n_keys);
    std::vector<int64_t> top_index(2 * topk), next(topk), candidates(n_keys);
#pragma omp for schedule(static)
    for (int64_t nh = 0; nh < num_tokens * heads; ++nh) {
      const int64_t n = nh / heads, h = nh % heads;
      for (int64_t c = 0; c < 2; ++c)
        select_topk(sub_scores + ((h * 2 + c) * num_tokens + n) * n_keys, n_keys, topk, top.data() + c * topk,
                    top_index.data() + c * topk, scratch.data(), candidates.data());
      merge_topk(top.data(), top_index.data(), top.data() + topk, top_index.data() + topk, topk, n_keys,
                 next.data(), scores + nh * topk, indices + nh * topk);
    }
  }
}

// Width of a D tile whose accumulators stay in registers (16 AVX-512 registers of fp32).
constexpr int64_t kTile = 256;
// Rows are prefetched this many reads ahead: random rows of a table larger than the
// caches cost a DRAM and TLB miss each, which the hardware prefetcher cannot predict.
constexpr int64_t kPrefetchReads = 8;

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

template <typename T>
void gather_forward_impl(const T* values, const int64_t* indices, const typename Accumulate<T>::type* weights,
                         int64_t* counts, const bool* valid, T* out, int64_t num_rows, int64_t num_tokens,
                         int64_t per_token, int64_t dim, int threads) {
  using A = typename Accumulate<T>::type;
  // Each thread counts into its own histogram (no atomics); they are summed after the pass.
  std::vector<std::vector<int64_t>> local_counts(counts != nullptr ? threads : 0);
#pragma omp parallel num_threads(threads)
  {
  int64_t* my_counts = nullptr;
  if (counts != nullptr) {
    local_counts[omp_get_thread_num()].assign(num_rows, 0);
    my_counts = local_counts[omp_get_thread_num()].data();
  }
#pragma omp for schedule(static)
  for (int64_t n = 0; n < num_tokens; ++n) {
    const int64_t* token_indices = indices + n * per_token;
    const A* token_weights = weights + n * per_token;
    for (int64_t d0 = 0; d0 < dim; d0 += kTile) {
      const int64_t width = std::min(kTile, dim - d0);
      // Read l + kPrefetchReads of this tile, or the start of the next tile / token.
      const bool last_tile = d0 + kTile >= dim;
      const int64_t* next_indices = last_tile ? token_indices + per_token : token_indices;
      const int64_t next_d0 = last_tile ? 0 : d0 + kTile;
      const int64_t next_width = last_tile ? std::min(kTile, dim) : std::min(kTile, dim - next_d0);
      const bool has_next = !(last_tile && n + 1 == num_tokens);
      A sum[kTile] = {};
      for (int64_t l = 0; l < per_token; ++l) {
        const int64_t ahead = l + kPrefetchReads;
        if (ahead < per_token)
          prefetch(values + token_indices[ahead] * dim + d0, width * sizeof(T));
        else if (has_next && ahead - per_token < per_token)
          prefetch(values + next_indices[ahead - per_token] * dim + next_d0, next_width * sizeof(T));
        const A w = token_weights[l];
        const T* row = values + token_indices[l] * dim + d0;
        if (width == kTile) {
#pragma omp simd
          for (int64_t i = 0; i < kTile; ++i) sum[i] += w * load(row[i]);
        } else {
#pragma omp simd
          for (int64_t i = 0; i < width; ++i) sum[i] += w * load(row[i]);
        }
      }
      for (int64_t i = 0; i < width; ++i) store(sum[i], out + n * dim + d0 + i);
    }
    if (my_counts != nullptr && (valid == nullptr || valid[n])) {
      for (int64_t l = 0; l < per_token; ++l) ++my_counts[token_indices[l]];
    }
  }
  if (counts != nullptr) {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < num_rows; ++row)
      for (const auto& thread_counts : local_counts)
        if (!thread_counts.empty()) counts[row] += thread_counts[row];
  }
  }
}

template <typename T>
void gather_backward_weights_impl(const T* grad_out, const T* values, const int64_t* indices,
                                  typename Accumulate<T>::type* grad_weights, int64_t num_tokens, int64_t per_token,
                                  int64_t dim, int threads) {
  using A = typename Accumulate<T>::type;
  const int64_t reads = num_tokens * per_token;
#pragma omp parallel num_threads(threads)
  {
    std::vector<A> g(dim);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < num_tokens; ++n) {
      for (int64_t d = 0; d < dim; ++d) g[d] = load(grad_out[n * dim + d]);
      for (int64_t read = n * per_token; read < (n + 1) * per_token; ++read) {
        if (read + kPrefetchReads < reads) prefetch(values + indices[read + kPrefetchReads] * dim, dim * sizeof(T));
        const T* row = values + indices[read] * dim;
        A dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += g[d] * load(row[d]);
        grad_weights[read] = dot;
      }
    }
  }
}

template <typename T>
void gather_backward_values_impl(const T* grad_out, const int64_t* indices, const typename Accumulate<T>::type* weights,
                                 const int64_t* update_rows, int64_t num_update_rows, typename Accumulate<T>::type* grad,
                                 int64_t num_rows, int64_t num_tokens, int64_t per_token, int64_t dim, int threads) {
  using A = typename Accumulate<T>::type;
  const int64_t reads = num_tokens * per_token;
  const bool sparse = update_rows != nullptr;
  const int64_t out_rows = sparse ? num_update_rows : num_rows;
  // Output row of each table row (-1: dropped).
  std::vector<int64_t> row_slot;
  if (sparse) {
    row_slot.assign(num_rows, -1);
    for (int64_t t = 0; t < num_update_rows; ++t) row_slot[update_rows[t]] = t;
  }
  auto target = [&](int64_t read) { return sparse ? row_slot[indices[read]] : indices[read]; };
  // Counting sort of the reads by output row, stable in read order: begin[r]..begin[r+1]
  // of `order` are the reads of row r, in the order (n, l).
  std::vector<int64_t> begin(out_rows + 1, 0), order;
  for (int64_t read = 0; read < reads; ++read) {
    const int64_t r = target(read);
    if (r >= 0) ++begin[r + 1];
  }
  for (int64_t r = 0; r < out_rows; ++r) begin[r + 1] += begin[r];
  order.resize(begin[out_rows]);
  {
    std::vector<int64_t> cursor(begin.begin(), begin.end() - 1);
    for (int64_t read = 0; read < reads; ++read) {
      const int64_t r = target(read);
      if (r >= 0) order[cursor[r]++] = read;
    }
  }
  // Each output row is owned by one thread and summed in read order.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t r = 0; r < out_rows; ++r) {
    A* out = grad + r * dim;
    std::fill(out, out + dim, A(0));
    for (int64_t p = begin[r]; p < begin[r + 1]; ++p) {
      if (p + kPrefetchReads < begin[out_rows])
        prefetch(grad_out + (order[p + kPrefetchReads] / per_token) * dim, dim * sizeof(T));
      const int64_t read = order[p];
      const A w = weights[read];
      const T* g = grad_out + (read / per_token) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] += w * load(g[d]);
    }
  }
}

}  // namespace

#define SMF_CPU_DISPATCH(dtype, ...)                 \
  switch (dtype) {                                   \
    case DType::Float32: {                           \
      using T = float;                               \
      __VA_ARGS__;                                   \
      break;                                         \
    }                                                \
    case DType::Float64: {                           \
      using T = double;                              \
      __VA_ARGS__;                                   \
      break;                                         \
    }                                                \
    case DType::BFloat16: {                          \
      using T = BFloat16;                            \
      __VA_ARGS__;                                   \
      break;                                         \
    }                                                \
  }

void topk_select(DType dtype, const void* sub_scores, void* scores, int64_t* indices, int64_t num_tokens,
                 int64_t heads, int64_t n_keys, int64_t topk, int threads) {
  if (dtype == DType::Float64)
    topk_select_impl(static_cast<const double*>(sub_scores), static_cast<double*>(scores), indices, num_tokens, heads,
                     n_keys, topk, threads);
  else
    topk_select_impl(static_cast<const float*>(sub_scores), static_cast<float*>(scores), indices, num_tokens, heads,
                     n_keys, topk, threads);
}

void gather_forward(DType dtype, const void* values, const int64_t* indices, const void* weights, int64_t* counts,
                    const bool* valid, void* out, int64_t num_rows, int64_t num_tokens, int64_t per_token,
                    int64_t dim, int threads) {
  SMF_CPU_DISPATCH(dtype, gather_forward_impl(static_cast<const T*>(values), indices,
                                              static_cast<const typename Accumulate<T>::type*>(weights), counts,
                                              valid, static_cast<T*>(out), num_rows, num_tokens, per_token, dim,
                                              threads));
}

void gather_backward_weights(DType dtype, const void* grad_out, const void* values, const int64_t* indices,
                             void* grad_weights, int64_t num_tokens, int64_t per_token, int64_t dim, int threads) {
  SMF_CPU_DISPATCH(dtype, gather_backward_weights_impl(static_cast<const T*>(grad_out), static_cast<const T*>(values),
                                                       indices, static_cast<typename Accumulate<T>::type*>(grad_weights),
                                                       num_tokens, per_token, dim, threads));
}

void gather_backward_values(DType dtype, const void* grad_out, const int64_t* indices, const void* weights,
                            const int64_t* update_rows, int64_t num_update_rows, void* grad, int64_t num_rows,
                            int64_t num_tokens, int64_t per_token, int64_t dim, int threads) {
  SMF_CPU_DISPATCH(dtype, gather_backward_values_impl(
                              static_cast<const T*>(grad_out), indices,
                              static_cast<const typename Accumulate<T>::type*>(weights), update_rows, num_update_rows,
                              static_cast<typename Accumulate<T>::type*>(grad), num_rows, num_tokens, per_token, dim,
                              threads));
}

}  // namespace smf::cpu
