// CPU kernels of the weighted gather: the forward with its read counts and the backwards (see cpu_kernels.h).
#include "cpu_common.h"

namespace smf::cpu {
namespace {

// Width of a D tile whose accumulators stay in registers (16 AVX-512 registers of fp32).
constexpr int64_t kTile = 256;
// Rows are prefetched this many reads ahead: random rows of a table larger than the
// caches cost a DRAM and TLB miss each, which the hardware prefetcher cannot predict.
constexpr int64_t kPrefetchReads = 8;

// Lanes of the dot product's independent partial sums: with a single vector accumulator each
// fused multiply-add waits for the previous one (4-5 cycles of latency); 32 lanes are 4 AVX2
// (2 AVX-512) registers.
constexpr int64_t kDotLanes = 32;

// The lanes' sum as a tree (halves added: 16 + 16, 8 + 8, ...), a fixed order.
template <typename A>
inline A sum_lanes(A* lanes) {
  for (int64_t width = kDotLanes / 2; width >= 1; width /= 2)
    for (int64_t i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The 32 lanes in 4 ymm registers (a loop over a lanes array keeps them on the stack).
struct Lanes8x4 {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};

  template <typename X, typename Y>
  void add(const X* a, const Y* b) {  // 32 products
    for (int v = 0; v < 4; ++v) acc[v] = _mm256_fmadd_ps(load8(a + 8 * v), load8(b + 8 * v), acc[v]);
  }
  template <typename X, typename Y>
  void add_tail(const X* a, const Y* b, int64_t count) {  // count < 32, zero-padded (0 * 0 leaves a lane as it is)
    alignas(32) float tail_a[kDotLanes] = {}, tail_b[kDotLanes] = {};
    for (int64_t i = 0; i < count; ++i) {
      tail_a[i] = load(a[i]);
      tail_b[i] = load(b[i]);
    }
    add(tail_a, tail_b);
  }
  float sum() const {  // sum_lanes' tree: lanes i + 16, i + 8, i + 4, i + 2, i + 1
    const __m256 half = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
};
#endif

// sum over d < n of a[d] * b[d] in the accumulation type: lane i sums the d = i mod 32, then
// sum_lanes; a fixed order for every n, which backward_read keeps, so the fused and the separate
// weight gradients agree bit for bit.
template <typename A, typename X, typename Y>
inline A dot(const X* a, const Y* b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    Lanes8x4 lanes;
    int64_t d = 0;
    for (; d + kDotLanes <= n; d += kDotLanes) lanes.add(a + d, b + d);
    if (d < n) lanes.add_tail(a + d, b + d, n - d);
    return lanes.sum();
  }
#endif
  A lanes[kDotLanes] = {};
  int64_t d = 0;
  for (; d + kDotLanes <= n; d += kDotLanes) {
#pragma omp simd
    for (int64_t i = 0; i < kDotLanes; ++i) lanes[i] += load(a[d + i]) * load(b[d + i]);
  }
  for (int64_t i = 0; d + i < n; ++i) lanes[i] += load(a[d + i]) * load(b[d + i]);
  return sum_lanes(lanes);
}

inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

#if defined(__AVX2__) && defined(__FMA__)
inline void prefetch_l2(const void* start, int64_t bytes) {  // prefetcht1: into L2, not L1
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
}
#endif

// Slot t of each of T distinct table rows rows[t], found by open addressing in a table of at least 2 T
// entries: what the sparse backwards ask of a row, without an array the size of the table (8 MB zeroed per
// call at 1M rows).
class RowSlots {
 public:
  RowSlots(const int64_t* rows, int64_t count) {
    int64_t capacity = 16;
    while (capacity < 2 * count) capacity *= 2;
    for (shift_ = 64; (int64_t(1) << (64 - shift_)) < capacity; --shift_) {
    }
    rows_.assign(capacity, -1);
    slots_.resize(capacity);
    for (int64_t t = 0; t < count; ++t) {
      int64_t at = home(rows[t]);
      while (rows_[at] >= 0) at = (at + 1) & (capacity - 1);
      rows_[at] = rows[t];
      slots_[at] = t;
    }
  }
  // The slot of table row `row`, or -1 when it is not one of the rows.
  int64_t find(int64_t row) const {
    const int64_t mask = static_cast<int64_t>(rows_.size()) - 1;
    for (int64_t at = home(row);; at = (at + 1) & mask) {
      if (rows_[at] == row) return slots_[at];
      if (rows_[at] < 0) return -1;
    }
  }

 private:
  int64_t home(int64_t row) const {  // Fibonacci hashing: the top bits of row * 2^64 / golden ratio
    return static_cast<int64_t>((static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  int shift_ = 64;
  std::vector<int64_t> rows_, slots_;
};

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 tile: 14 ymm accumulators (112 floats) stay in registers, next to the broadcast
// weight and one temporary; the generic loop's 256-wide array spills without AVX-512.
// AVX-512 builds take this forward too, for its column groups: on this project's AVX-512 EPYC VM (32 MB L3), at
// N = 2048, L = 64, D = 896 fp32 and 16k rows, one thread, it took 23 ms where the generic whole-row loop took
// 40 ms (F.embedding_bag: 33 ms), bit for bit the same sums (each output a d-ordered chain of FMAs from zero).
constexpr int kAvx2Vectors = 14;
constexpr int64_t kAvx2Tile = 8 * kAvx2Vectors;

// out[d0 .. d0 + 112) of one token. Column groups: prefetches this tile of the read kPrefetchReads
// ahead (past the token's last read: the next token's reads, at the next tile or the group's first).
// Whole rows (whole_rows, g0 = 0): prefetches this tile of the next token's read l into L2, so that
// the token's eight tile passes bring the next token's rows in whole, a tile's lines at a time, while
// this token's rows are read from L2. (Prefetching a whole row 8 reads ahead into L1 stalled on the
// prefetches: 80 ms at 1M rows, more than the column groups' 70.)
template <typename T>
inline void gather_tile_avx2(const T* values, const int64_t* token_indices, const float* token_weights,
                             int64_t per_token, int64_t reads_left, int64_t dim, int64_t d0, int64_t g0,
                             int64_t g1, bool whole_rows, float* sum) {
  __m256 acc[kAvx2Vectors];
  for (int v = 0; v < kAvx2Vectors; ++v) acc[v] = _mm256_setzero_ps();
  const int64_t next_d0 = d0 + 2 * kAvx2Tile <= g1 ? d0 + kAvx2Tile : g0;
  for (int64_t l = 0; l < per_token; ++l) {
    const int64_t ahead = l + kPrefetchReads;
    if (whole_rows) {
      if (per_token < reads_left) prefetch_l2(values + token_indices[per_token + l] * dim + d0, kAvx2Tile * sizeof(T));
    } else if (ahead < per_token) {
      prefetch(values + token_indices[ahead] * dim + d0, kAvx2Tile * sizeof(T));
    } else if (ahead < reads_left) {
      prefetch(values + token_indices[ahead - (next_d0 != g0 ? per_token : 0)] * dim + next_d0,
               kAvx2Tile * sizeof(T));
    }
    const __m256 w = _mm256_set1_ps(token_weights[l]);
    const T* row = values + token_indices[l] * dim + d0;
    for (int v = 0; v < kAvx2Vectors; ++v) acc[v] = _mm256_fmadd_ps(w, load8(row + 8 * v), acc[v]);
  }
  for (int v = 0; v < kAvx2Vectors; ++v) _mm256_storeu_ps(sum + 8 * v, acc[v]);
}

// Columns per pass over the tokens (a multiple of the AVX2 tile): the forward sweeps the tokens
// once per group of columns, so that the (num_rows x group) slice of the table it reads at random
// stays in the last-level cache. With whole rows a table larger than L3 is read from DRAM at every
// read: at N = 4096, D = 896 on the project's 2-core AVX2 VM (32 MB L3), fp32 went from 1.0x
// F.embedding_bag (whole rows) to 1.8x (224-column groups), bf16 from 0.78x to 1.05-1.14x (448).
// The budget is fixed at 16 MB, half the 32 MB L3 one EPYC core complex shares (out and the ids
// stream through the rest): sysconf reports the whole chip's L3 there (256 MB on that VM), more
// than one core ever sees. A smaller cache only costs extra passes over the ids and weights.
constexpr int64_t kGatherCacheBudget = int64_t(16) << 20;
// Past this (a table over 32 MB, the L3, in fp32 at D = 896), whole rows in one pass, the next token's rows
// prefetched into L2 during this token's (gather_tile_avx2): each row's lines stream in together, one TLB miss a
// row instead of one per column group. On the AVX-512 EPYC VM (one thread, N = 2048, L = 64, D = 896 fp32,
// uniform random ids, best of 3, column groups -> whole rows): 16k rows 32.8 -> 25.6 ms, 40k 39.0 -> 28.3,
// 65k 49.1 -> 32.4, 262k 76.7 -> 37.1, 1M 92.8 -> 35.2.
constexpr int64_t kGatherWholeRowsAbove = int64_t(4) << 20;

inline bool gather_whole_rows(int64_t num_rows, int64_t element_bytes) {
  return num_rows * element_bytes * kAvx2Tile > kGatherWholeRowsAbove;
}

inline int64_t gather_column_group(int64_t num_rows, int64_t element_bytes) {
  const int64_t tile_bytes = std::max<int64_t>(1, num_rows * element_bytes * kAvx2Tile);
  return std::max<int64_t>(1, kGatherCacheBudget / tile_bytes) * kAvx2Tile;
}
#endif

template <typename T>
void gather_forward_impl(const T* values, const int64_t* indices, const typename Accumulate<T>::type* weights,
                         int64_t* counts, const bool* valid, T* out, int64_t num_rows, int64_t num_tokens,
                         int64_t per_token, int64_t dim, int threads) {
  using A = typename Accumulate<T>::type;
  // With several threads and at least as many reads as rows, each thread counts into its own (M,) histogram (no
  // atomics) and they are summed after the pass. Otherwise the reads are counted straight into counts after it, one
  // pass over the ids: no (M,) array per call (a decoded token at 1M slots would zero and add 8 MB a thread).
  const bool local_histograms = counts != nullptr && threads > 1 && num_tokens * per_token >= num_rows;
  std::vector<std::vector<int64_t>> local_counts(local_histograms ? threads : 0);
#pragma omp parallel num_threads(threads)
  {
  int64_t* my_counts = nullptr;
  if (local_histograms) {
    local_counts[omp_get_thread_num()].assign(num_rows, 0);
    my_counts = local_counts[omp_get_thread_num()].data();
  }
  int64_t d_start = 0;  // columns before it were done by a vector path
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (!std::is_same_v<T, double>) {
    const int64_t vector_cols = dim / kAvx2Tile * kAvx2Tile;
    const bool whole_rows = gather_whole_rows(num_rows, sizeof(T));
    const int64_t group = whole_rows ? std::max<int64_t>(1, vector_cols) : gather_column_group(num_rows, sizeof(T));
    for (int64_t g0 = 0; g0 < vector_cols; g0 += group) {
      const int64_t g1 = std::min(vector_cols, g0 + group);
#pragma omp for schedule(static)
      for (int64_t n = 0; n < num_tokens; ++n) {
        alignas(32) float sum[kAvx2Tile];
        const int64_t reads_left = (num_tokens - n) * per_token;
        for (int64_t d0 = g0; d0 < g1; d0 += kAvx2Tile) {
          gather_tile_avx2(values, indices + n * per_token, weights + n * per_token, per_token, reads_left, dim,
                           d0, g0, g1, whole_rows, sum);
          for (int64_t i = 0; i < kAvx2Tile; ++i) store(sum[i], out + n * dim + d0 + i);
        }
      }
    }
    d_start = vector_cols;
  }
#endif
#pragma omp for schedule(static)
  for (int64_t n = 0; n < num_tokens; ++n) {
    const int64_t* token_indices = indices + n * per_token;
    const A* token_weights = weights + n * per_token;
    for (int64_t d0 = d_start; d0 < dim; d0 += kTile) {
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
  if (local_histograms) {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < num_rows; ++row)
      for (const auto& thread_counts : local_counts)
        if (!thread_counts.empty()) counts[row] += thread_counts[row];
  }
  }
  if (counts != nullptr && !local_histograms)
    for (int64_t n = 0; n < num_tokens; ++n)
      if (valid == nullptr || valid[n])
        for (int64_t l = 0; l < per_token; ++l) ++counts[indices[n * per_token + l]];
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
        grad_weights[read] = dot<A>(g.data(), row, dim);
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
  // Output row of each read (-1: dropped); sparse, each read's looked up once.
  std::vector<int64_t> read_slot;
  if (sparse) {
    const RowSlots slot_of(update_rows, num_update_rows);
    read_slot.resize(reads);
    for (int64_t read = 0; read < reads; ++read) read_slot[read] = slot_of.find(indices[read]);
  }
  auto target = [&](int64_t read) { return sparse ? read_slot[read] : indices[read]; };
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

// out += w * g over cols entries (backward_read's value-gradient part).
template <typename T, typename A>
inline void add_scaled(const T* g, A w, A* out, int64_t cols) {
#pragma omp simd
  for (int64_t d = 0; d < cols; ++d) out[d] += w * load(g[d]);
}

// One read of the fused backward: returns <row, g> (the weight gradient's part, as dot takes it)
// and adds w * g to out (when not null), loading g once for both.
template <typename T, typename A>
inline A backward_read(const T* row, const T* g, A w, A* out, int64_t cols) {
  if (out == nullptr) return dot<A>(row, g, cols);
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    Lanes8x4 lanes;
    const __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + kDotLanes <= cols; d += kDotLanes) {
      for (int v = 0; v < 4; ++v) {
        const __m256 x = load8(g + d + 8 * v);
        lanes.acc[v] = _mm256_fmadd_ps(load8(row + d + 8 * v), x, lanes.acc[v]);
        _mm256_storeu_ps(out + d + 8 * v, _mm256_fmadd_ps(wv, x, _mm256_loadu_ps(out + d + 8 * v)));
      }
    }
    if (d < cols) {
      lanes.add_tail(row + d, g + d, cols - d);
      for (int64_t i = d; i < cols; ++i) out[i] = std::fma(w, load(g[i]), out[i]);
    }
    return lanes.sum();
  }
#endif
  const A dot_product = dot<A>(row, g, cols);
  add_scaled(g, w, out, cols);
  return dot_product;
}

// Both gradients in one pass over the reads grouped by table row: row r's values stay in
// L1 while each of its reads loads grad_out[n] once, for the dot product of the weight
// gradient and for the row's value gradient. Values are read once in all, not once per read.
//
// Sparse without a weight gradient (the SMF step's backward, values training alone), only the reads of
// the T update rows count: they are grouped by output slot (RowSlots), T groups, and the call makes nothing
// the size of the table (at 1M rows it made three 8 MB arrays, zeroed and scanned, per call). With a weight
// gradient every read counts and the reads are grouped by table row: (M,) counts and offsets, so that the
// rows are read once each, in ascending order.
template <typename T>
void gather_backward_impl(const T* grad_out, const T* values, const int64_t* indices,
                          const typename Accumulate<T>::type* weights, const int64_t* update_rows,
                          int64_t num_update_rows, typename Accumulate<T>::type* grad_values,
                          typename Accumulate<T>::type* grad_weights, int64_t num_rows,
                          int64_t num_tokens, int64_t per_token, int64_t dim, int threads) {
  using A = typename Accumulate<T>::type;
  if (grad_values == nullptr && grad_weights == nullptr) return;
  const int64_t reads = num_tokens * per_token;
  const bool sparse = update_rows != nullptr;
  const bool by_slot = sparse && grad_weights == nullptr;
  // Output slot of a table row (-1: no value gradient): empty unless sparse.
  const RowSlots slot_of(update_rows, sparse ? num_update_rows : 0);
  // Group of each read: by_slot, its row's slot (-1: left out of the sort), looked up once; else its row.
  const int64_t groups = by_slot ? num_update_rows : num_rows;
  std::vector<int64_t> read_slot(by_slot ? reads : 0);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t read = 0; read < static_cast<int64_t>(read_slot.size()); ++read)
    read_slot[read] = slot_of.find(indices[read]);
  auto group_of = [&](int64_t read) { return by_slot ? read_slot[read] : indices[read]; };
  // Counting sort of the reads by group, stable in read order, in parallel: each of
  // `parts` consecutive ranges of reads is counted and placed by one thread, its reads of a
  // group after those of the ranges before it (the same order whatever the thread count; the
  // serial sort took 6 ms at N = 4096 while the other thread waited).
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, reads / 65536));
  std::vector<int64_t> begin(groups + 1, 0), cursor(parts * groups, 0);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t part = 0; part < parts; ++part) {
    int64_t* count = cursor.data() + part * groups;
    for (int64_t read = part * reads / parts; read < (part + 1) * reads / parts; ++read) {
      const int64_t group = group_of(read);
      if (group >= 0) ++count[group];
    }
  }
  // cursor[part][g]: where part's first read of group g goes.
  for (int64_t g = 0; g < groups; ++g) {
    int64_t at = begin[g];
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t count = cursor[part * groups + g];
      cursor[part * groups + g] = at;
      at += count;
    }
    begin[g + 1] = at;
  }
  const int64_t total = begin[groups];
  // The p-th read in group order: order[p] its index in (N, L), token[p] the row of grad_out it
  // reads, weight[p] its weight; the pass below reads them in sequence. Allocated here, outside
  // the parallel region, so that running out of memory raises (MemoryError) instead of aborting.
  const std::unique_ptr<int64_t[]> order(new int64_t[total]), token(new int64_t[total]);
  const std::unique_ptr<A[]> weight(new A[total]);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
  for (int64_t part = 0; part < parts; ++part) {
    int64_t* next = cursor.data() + part * groups;
    for (int64_t read = part * reads / parts; read < (part + 1) * reads / parts; ++read) {
      const int64_t group = group_of(read);
      if (group >= 0) order[next[group]++] = read;
    }
  }
#pragma omp for schedule(static)
  for (int64_t p = 0; p < total; ++p) {
    token[p] = order[p] / per_token;
    weight[p] = weights[order[p]];
  }
  // Sparse by table row, an update row may have no reads: every output row is zeroed first.
  const bool group_is_slot = by_slot || !sparse;
  if (!group_is_slot && grad_values != nullptr) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_update_rows; ++t) std::fill(grad_values + t * dim, grad_values + (t + 1) * dim, A(0));
  }
#pragma omp for schedule(dynamic, 64)
  for (int64_t g = 0; g < groups; ++g) {
    A* out = nullptr;
    if (grad_values != nullptr && group_is_slot) {
      out = grad_values + g * dim;
      std::fill(out, out + dim, A(0));
    } else if (grad_values != nullptr && begin[g] < begin[g + 1]) {
      const int64_t slot = slot_of.find(g);
      out = slot >= 0 ? grad_values + slot * dim : nullptr;
    }
    for (int64_t p = begin[g]; p < begin[g + 1]; ++p) {
      if (p + kPrefetchReads < total) prefetch(grad_out + token[p + kPrefetchReads] * dim, dim * sizeof(T));
      const T* g_row = grad_out + token[p] * dim;
      if (grad_weights == nullptr) {  // no dot product: the table is not read
        add_scaled(g_row, weight[p], out, dim);
        continue;
      }
      // The dot product is taken whatever the row needs, so a weight gradient does not
      // depend on which rows get a value gradient (update_rows).
      grad_weights[order[p]] = backward_read(values + g * dim, g_row, weight[p], out, dim);
    }
  }
  }
}

}  // namespace

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

void gather_backward(DType dtype, const void* grad_out, const void* values, const int64_t* indices,
                     const void* weights, const int64_t* update_rows, int64_t num_update_rows, void* grad_values,
                     void* grad_weights, int64_t num_rows, int64_t num_tokens, int64_t per_token, int64_t dim,
                     int threads) {
  SMF_CPU_DISPATCH(dtype, gather_backward_impl(
                              static_cast<const T*>(grad_out), static_cast<const T*>(values), indices,
                              static_cast<const typename Accumulate<T>::type*>(weights), update_rows, num_update_rows,
                              static_cast<typename Accumulate<T>::type*>(grad_values),
                              static_cast<typename Accumulate<T>::type*>(grad_weights), num_rows, num_tokens,
                              per_token, dim, threads));
}

}  // namespace smf::cpu
