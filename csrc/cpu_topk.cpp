// CPU kernels of the product-key top-k (see cpu_kernels.h): the sub-key selection, the fused float32 forward
// and the backward.
#include "cpu_common.h"

#include <functional>

namespace smf::cpu {
namespace {

// The ranking every backend follows (smf_kernels.reference.ranked_topk): torch.topk's
// order made total, NaN above +inf above every finite value above -inf. ranks_above(a, b):
// a comes strictly before b (equal scores, NaNs included, keep the lower index first).
template <typename A>
inline bool ranks_above(A a, A b) {
  return a > b || (a != a && b == b);
}

// Top `k` of s[0..n), sorted descending under ranks_above; on ties the lower index comes first.
// Insertion into a sorted list: the general path.
template <typename A>
void insertion_topk(const A* s, int64_t n, int64_t k, A* top_values, int64_t* top_indices) {
  int64_t filled = 0;
  for (int64_t j = 0; j < n; ++j) {
    const A v = s[j];
    if (filled == k && !ranks_above(v, top_values[k - 1])) continue;
    int64_t pos = filled < k ? filled++ : k - 1;
    for (; pos > 0 && ranks_above(v, top_values[pos - 1]); --pos) {
      top_values[pos] = top_values[pos - 1];
      top_indices[pos] = top_indices[pos - 1];
    }
    top_values[pos] = v;
    top_indices[pos] = j;
  }
}

#if defined(__AVX2__)
// Largest k <= 16 of float32 scores kept sorted in 16 lanes (values lo: lanes 0-7, hi: 8-15, and
// their indices), an insertion being vector compares and blends without branches: a score goes
// after the kept ones >= it (equal scores keep the lower index first when indices increase), the
// ones below move down a lane. Insertion into an array mispredicted on nearly every candidate and
// took half of the lookup's selection time (perf, N = 4096).
struct Top16 {
  __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), hi = lo;
  __m256i lo_index = _mm256_setzero_si256(), hi_index = lo_index;

  void insert(float value, int32_t index) {
    const __m256 v = _mm256_set1_ps(value);
    const __m256i j = _mm256_set1_epi32(index);
    // Lane i's neighbour above: lane i - 1, lane 8's is lane 7, and lane 0 has +inf (always kept).
    // One rotation per register, and the neighbours' keep masks by compares: 4 lane-crossing
    // permutes per insertion instead of 9 (the selection at N = 4096 ran 12-14% faster).
    const __m256i rotate = _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6);
    const __m256 rotated_lo = _mm256_permutevar8x32_ps(lo, rotate);
    const __m256 down_lo = _mm256_blend_ps(rotated_lo, _mm256_set1_ps(std::numeric_limits<float>::infinity()), 0x01);
    const __m256 down_hi = _mm256_blend_ps(_mm256_permutevar8x32_ps(hi, rotate), rotated_lo, 0x01);
    const __m256i down_lo_index = _mm256_permutevar8x32_epi32(lo_index, rotate);
    const __m256i down_hi_index =
        _mm256_blend_epi32(_mm256_permutevar8x32_epi32(hi_index, rotate), down_lo_index, 0x01);
    const __m256 keep_lo = _mm256_cmp_ps(lo, v, _CMP_GE_OQ), keep_hi = _mm256_cmp_ps(hi, v, _CMP_GE_OQ);
    const __m256 above_kept_lo = _mm256_cmp_ps(down_lo, v, _CMP_GE_OQ);
    const __m256 above_kept_hi = _mm256_cmp_ps(down_hi, v, _CMP_GE_OQ);
    // kept ? itself : (neighbour above kept ? the new score : the neighbour above)
    lo = _mm256_blendv_ps(_mm256_blendv_ps(down_lo, v, above_kept_lo), lo, keep_lo);
    hi = _mm256_blendv_ps(_mm256_blendv_ps(down_hi, v, above_kept_hi), hi, keep_hi);
    lo_index = blend_index(blend_index(down_lo_index, j, above_kept_lo), lo_index, keep_lo);
    hi_index = blend_index(blend_index(down_hi_index, j, above_kept_hi), hi_index, keep_hi);
  }

  static __m256i blend_index(__m256i a, __m256i b, __m256 take_b) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), take_b));
  }

  template <typename A>
  void write(int64_t k, A* top_values, int64_t* top_indices) const {  // the first k lanes
    alignas(32) float values[16];
    alignas(32) int32_t indices[16];
    _mm256_store_ps(values, lo);
    _mm256_store_ps(values + 8, hi);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), lo_index);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices + 8), hi_index);
    for (int64_t r = 0; r < k; ++r) {
      top_values[r] = values[r];
      top_indices[r] = indices[r];
    }
  }
};

// Left-packing permutations: byte i of lanes[m] is the i-th lane set in the 8-bit mask m.
struct PackTable {
  uint64_t lanes[256];
  constexpr PackTable() : lanes() {
    for (int mask = 0; mask < 256; ++mask) {
      int at = 0;
      for (int lane = 0; lane < 8; ++lane)
        if (mask >> lane & 1) lanes[mask] |= static_cast<uint64_t>(lane) << (8 * at++);
    }
  }
};
constexpr PackTable kPackTable;

// The candidates for the float top-k (k <= 16) of s[0..n), n a multiple of 8, in index order:
// the scores >= t, where t is the smallest r-th largest of the 8 lane groups {j : j % 8 == g} and
// r = ceil(k / 8), so that 8 r >= k scores are >= t and the top k are among the candidates. About
// 31 of 128 at k = 16 on random scores (43 with the k groups' maxima of select_topk). values and
// indices hold n + 8 (a packed store writes 8 lanes). Returns the count, or -1 where the vector
// insertion does not apply: a NaN, or t = -inf (its fillers are -inf).
inline int64_t top16_candidates(const float* s, int64_t n, int64_t k, float* values, int32_t* indices) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 first = minus_inf, second = minus_inf;  // each lane's largest and second largest
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    second = _mm256_max_ps(second, _mm256_min_ps(first, x));
    first = _mm256_max_ps(first, x);
  }
  __m256 lane_t = k > 8 ? second : first;
  __m128 t4 = _mm_min_ps(_mm256_castps256_ps128(lane_t), _mm256_extractf128_ps(lane_t, 1));
  t4 = _mm_min_ps(t4, _mm_movehl_ps(t4, t4));
  const float t = _mm_cvtss_f32(_mm_min_ss(t4, _mm_movehdup_ps(t4)));
  if (!(t > -std::numeric_limits<float>::infinity())) return -1;  // -inf, or NaN from a NaN score
  const __m256 tv = _mm256_set1_ps(t);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t count = 0;
  int nan = 0;
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(x, tv, _CMP_GE_OQ));
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i order = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(kPackTable.lanes[mask])));
    _mm256_storeu_ps(values + count, _mm256_permutevar8x32_ps(x, order));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(indices + count), _mm256_permutevar8x32_epi32(index, order));
    count += __builtin_popcount(mask);
    index = _mm256_add_epi32(index, eight);
  }
  return nan ? -1 : count;
}
#endif

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
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    candidates[count] = j;
    candidate_values[count] = s[j];
    count += s[j] >= t;
    nan |= s[j] != s[j];
  }
  if (nan || count < k) {  // NaNs rank first but compare false with t: rank everything
    insertion_topk(s, n, k, top_values, top_indices);
    return;
  }
#if defined(__AVX2__)
  // Candidates above -inf and k <= 16: the vector insertion (its fillers are -inf).
  if constexpr (std::is_same_v<A, float>) {
    if (k <= 16 && t > -std::numeric_limits<float>::infinity() && n <= std::numeric_limits<int32_t>::max()) {
      Top16 top;
      for (int64_t p = 0; p < count; ++p) top.insert(candidate_values[p], static_cast<int32_t>(candidates[p]));
      top.write(k, top_values, top_indices);
      return;
    }
  }
#endif
  insertion_topk(candidate_values, count, k, top_values, top_indices);
  for (int64_t r = 0; r < k; ++r) top_indices[r] = candidates[top_indices[r]];
}

#if defined(__AVX2__)
// x / d for 0 <= x <= 16 and 1 <= d <= 16: merge_top16's rectangles and staircase by a
// table lookup instead of up to 31 integer divisions per merge.
struct QuotientTable {
  uint8_t of[17][17];
  constexpr QuotientTable() : of() {
    for (int x = 0; x <= 16; ++x)
      for (int d = 1; d <= 16; ++d) of[x][d] = static_cast<uint8_t>(x / d);
  }
};
constexpr QuotientTable kQuotients;

// merge_topk of finite float lists for k <= 16, with few branches: the frontier walk
// mispredicted and took a third of the lookup's selection time (perf, N = 4096). The top
// k sums lie in the staircase (i + 1)(j + 1) <= k (each other sum has k sums at or above it
// with lower ids) and are >= t, the largest corner a[m - 1] + b[ceil(k / m) - 1] of the
// rectangles of m x ceil(k / m) >= k sums (float addition is monotonic). Row 0, sorted and
// holding the lowest ids, is a Top16 as it stands; the other rows' candidates, about 16 at
// k = 16 on random scores, are inserted in candidate-id order, so equal sums keep the lower
// id first. Returns false where t = -inf (then candidates could tie the Top16's fillers); the
// caller walks instead. At k = 16 on random scores 160-180 ns a merge against the walk's 250-270
// (one core); on many exact ties the walk predicts well and is faster.
inline bool merge_top16(const float* a, const int64_t* a_index, const float* b, const int64_t* b_index, int64_t k,
                        int64_t n_keys, float* scores, int64_t* indices) {
  float t = -std::numeric_limits<float>::infinity();
  for (int64_t m = 1; m <= k; ++m) t = std::max(t, a[m - 1] + b[kQuotients.of[k - 1][m]]);  // ceil(k / m) - 1
  if (!(t > -std::numeric_limits<float>::infinity())) return false;
  alignas(32) float b16[16];  // b padded with -inf, whose sums are below t
  std::fill(b16, b16 + 16, -std::numeric_limits<float>::infinity());
  std::copy(b, b + k, b16);
  const __m256 b_lo = _mm256_load_ps(b16), b_hi = _mm256_load_ps(b16 + 8), tv = _mm256_set1_ps(t);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
  const __m256 a0 = _mm256_set1_ps(a[0]);
  Top16 top{_mm256_add_ps(a0, b_lo), _mm256_add_ps(a0, b_hi), lane, _mm256_add_epi32(lane, eight)};
  // The other rows' candidates as (sum, id i * 16 + j): their staircase is at most k / 2 <= 8
  // wide, columns 0-7, one packed store of 8 lanes per row.
  alignas(32) float values[16 * 8];
  alignas(32) int32_t ids[16 * 8];
  int64_t count = 0;
  for (int64_t i = 1; i < k && a[i] + b[0] >= t; ++i) {
    const __m256 sum = _mm256_add_ps(_mm256_set1_ps(a[i]), b_lo);
    const __m256i width = _mm256_set1_epi32(kQuotients.of[k][i + 1]);
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(sum, tv, _CMP_GE_OQ)) &
                     _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(width, lane)));
    const __m256i order = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(kPackTable.lanes[mask])));
    _mm256_storeu_ps(values + count, _mm256_permutevar8x32_ps(sum, order));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids + count),
                        _mm256_permutevar8x32_epi32(_mm256_add_epi32(_mm256_set1_epi32(int32_t(16 * i)), lane), order));
    count += __builtin_popcount(mask);
  }
  for (int64_t p = 0; p < count; ++p) top.insert(values[p], ids[p]);
  alignas(32) int64_t best[16];
  top.write(k, scores, best);
  for (int64_t r = 0; r < k; ++r) indices[r] = a_index[best[r] >> 4] * n_keys + b_index[best[r] & 15];
  return true;
}
#endif

// Top `k` sums a[i] + b[j] of two lists of length k sorted by ranks_above, by a frontier
// walk: row i's next candidate is b[next[i]]. next[] never increases with i, so
// rows past the first untouched one are dominated and not scanned. Equal sums: the
// lower candidate id i * k + j first. A non-finite a or b breaks the walk's premise
// (inf + -inf is NaN, which ranks first), so then all k * k sums are ranked, in
// candidate-id order, as the reference does.
template <typename A>
void merge_topk(const A* a, const int64_t* a_index, const A* b, const int64_t* b_index, int64_t k, int64_t n_keys,
                int64_t* next, A* scores, int64_t* indices) {
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) finite = finite && std::isfinite(a[i]) && std::isfinite(b[i]);
  if (!finite) {
    std::vector<A> sums(k * k);
    std::vector<int64_t> best(k);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < k; ++j) sums[i * k + j] = a[i] + b[j];
    insertion_topk(sums.data(), k * k, k, scores, best.data());
    for (int64_t r = 0; r < k; ++r) indices[r] = a_index[best[r] / k] * n_keys + b_index[best[r] % k];
    return;
  }
#if defined(__AVX2__)
  if constexpr (std::is_same_v<A, float>) {
    if (k <= 16 && merge_top16(a, a_index, b, b_index, k, n_keys, scores, indices)) return;
  }
#endif
  std::fill(next, next + k, 0);
  for (int64_t r = 0; r < k; ++r) {
    int64_t best = -1;
    A best_score = 0;
    for (int64_t i = 0; i < k; ++i) {
      if (next[i] == k) continue;
      const A score = a[i] + b[next[i]];
      if (best < 0 || ranks_above(score, best_score)) {
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

// Tokens whose sub-key scores are computed together and selected right away, while they
// are still in L1/L2 (2 x kTokenBlock x padded_keys fp32 per thread: 24 KB at n_keys = 128;
// 24 to 96 tokens timed the same on the AVX2 VM).
constexpr int64_t kTokenBlock = 24;
// Tokens per register tile of the score GEMM: AVX-512 tiles are 6 x 64 columns (24 of the 32 zmm
// registers accumulate), AVX2 tiles 6 x 16 (12 of the 16 ymm registers accumulate). On the project's
// AVX-512 EPYC VM (one thread, N = 2048, 4 heads, half 128) 6 x 64 tiles took the lookup from 58 to 51 ms
// at n_keys = 1024 and from 11.2 to 10.2 ms at 128 (4 x 64 tiles: 16 accumulators, a key load per 4 FMAs);
// 8 x 48 took 52 ms, 12 x 32 58 ms. The same scores bit for bit (each a d-ordered chain of FMAs).
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 6;
#else
constexpr int64_t kTileRows = 6;
#endif
static_assert(kTokenBlock % kTileRows == 0, "a block is whole tiles");
// Candidates above which the vector selection hands over to insertion sort.
constexpr int64_t kMaxRankCandidates = 64;

#if defined(__AVX512F__)
// out_r[j] = q_r . k[:, j] for R <= kTileRows query rows and the 16 * V columns of V panels of kt (panel v
// is (half, 16) row-major at kt + v * half * 16); the R x V accumulators stay in registers.
template <int R, int V>
inline void score_tile(const float* const* q, const float* kt, int64_t half, float* const* out) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < half; ++d) {
    __m512 k[V];
    for (int v = 0; v < V; ++v) k[v] = _mm512_loadu_ps(kt + (v * half + d) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r][d]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(b, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out[r] + 16 * v, acc[r][v]);
}

// The R-row tiles across all columns of kt (padded columns, a multiple of 16): 4 panels at a time.
template <int R>
inline void score_rows(const float* const* q, const float* kt, int64_t half, int64_t padded, float* const* out) {
  for (int64_t j0 = 0; j0 < padded;) {
    float* tile_out[R];
    for (int r = 0; r < R; ++r) tile_out[r] = out[r] + j0;
    const int64_t vectors = std::min<int64_t>(4, (padded - j0) / 16);
    switch (vectors) {
      case 4: score_tile<R, 4>(q, kt + j0 * half, half, tile_out); break;
      case 3: score_tile<R, 3>(q, kt + j0 * half, half, tile_out); break;
      case 2: score_tile<R, 2>(q, kt + j0 * half, half, tile_out); break;
      default: score_tile<R, 1>(q, kt + j0 * half, half, tile_out); break;
    }
    j0 += 16 * vectors;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// out_r[j] = q_r . k[:, j] for R <= kTileRows query rows and the 16 columns of the panel kt ((half, 16)
// row-major), summed in d order as the AVX-512 tiles do; the R x 2 accumulators stay in
// registers. Per d: 2 key loads and R broadcasts feed 2 R FMAs.
template <int R>
inline void score_tile(const float* const* q, const float* kt, int64_t half, float* const* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < half; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(q[r] + d);
      acc[r][0] = _mm256_fmadd_ps(b, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}

template <int R>
inline void score_rows(const float* const* q, const float* kt, int64_t half, int64_t padded, float* const* out) {
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    float* tile_out[R];
    for (int r = 0; r < R; ++r) tile_out[r] = out[r] + j0;
    score_tile<R>(q, kt + j0 * half, half, tile_out);
  }
}
#else
template <int R>
inline void score_rows(const float* const* q, const float* kt, int64_t half, int64_t padded, float* const* out) {
  for (int r = 0; r < R; ++r) {
    std::fill(out[r], out[r] + padded, 0.0f);
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      const float* panel = kt + j0 * half;
      for (int64_t d = 0; d < half; ++d) {
        const float b = q[r][d];
#pragma omp simd
        for (int64_t j = 0; j < 16; ++j) out[r][j0 + j] += b * panel[d * 16 + j];
      }
    }
  }
}
#endif

// Scores (rows, padded) of `rows` query rows q[r] against the sub-keys k (half, padded), padded a
// multiple of 16, stored as kt (padded / 16, half, 16): panels of 16 columns, each read in one
// contiguous stream (rows of k 512 bytes apart kept only 8 of L1's 64 sets busy, and AVX2 tiles
// reading them reached 75 instead of 88 GFLOP/s on one core). out[r * padded + j] = q[r] . k[:, j].
// Tiles of kTileRows rows, the last one as narrow as the rows left: a decoded token (1 row) costs
// one row of multiply-adds, not kTileRows. Every score is the same d-ordered sum whatever its tile.
template <int R>
void score_tail(const float* const* q, int64_t left, const float* kt, int64_t half, int64_t padded,
                float* const* out) {
  if constexpr (R > 1) {
    if (left < R) return score_tail<R - 1>(q, left, kt, half, padded, out);
  }
  score_rows<R>(q, kt, half, padded, out);
}

void block_scores(const float* const* q, int64_t rows, const float* kt, int64_t half, int64_t padded, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    float* tile_out[kTileRows];
    const int64_t left = std::min(kTileRows, rows - r0);
    for (int64_t r = 0; r < left; ++r) tile_out[r] = out + (r0 + r) * padded;
    score_tail<kTileRows>(q + r0, left, kt, half, padded, tile_out);
  }
}

#if defined(__AVX512F__)
// Order key of score s at index j: larger key = larger score, on equal scores the
// lower index. -0.0 is folded onto +0.0 so that they tie, as under float compares.
inline uint64_t order_key(float s, uint32_t j) {
  uint32_t bits;
  const float folded = s + 0.0f;
  std::memcpy(&bits, &folded, sizeof(bits));
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | static_cast<uint64_t>(~j);
}

// rank[p] = number of keys (of the V * 8 in keys, padded with 0) larger than keys[p].
template <int V>
inline void key_ranks(const uint64_t* keys, int64_t count, int64_t* rank) {
  __m512i key[V], above[V];
  const __m512i one = _mm512_set1_epi64(1);
  for (int v = 0; v < V; ++v) {
    key[v] = _mm512_loadu_si512(keys + 8 * v);
    above[v] = _mm512_setzero_si512();
  }
  for (int64_t c = 0; c < count; ++c) {
    const __m512i other = _mm512_set1_epi64(static_cast<long long>(keys[c]));
    for (int v = 0; v < V; ++v)
      above[v] = _mm512_mask_add_epi64(above[v], _mm512_cmpgt_epu64_mask(other, key[v]), above[v], one);
  }
  for (int v = 0; v < V; ++v) _mm512_storeu_si512(rank + 8 * v, above[v]);
}

// Lane l takes the larger of itself and its partner l ^ stride in this step of a
// bitonic sort of 16 lanes into descending order (blocks of `size` alternate direction).
constexpr __mmask16 take_max_mask(int size, int stride) {
  unsigned mask = 0;
  for (int lane = 0; lane < 16; ++lane)
    if (((lane & stride) == 0) != ((lane & size) != 0)) mask |= 1u << lane;
  return static_cast<__mmask16>(mask);
}

template <int Size, int Stride>
inline __m512 bitonic_step(__m512 x) {
  const __m512i partner = _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(Stride));
  const __m512 other = _mm512_permutexvar_ps(partner, x);
  return _mm512_mask_blend_ps(take_max_mask(Size, Stride), _mm512_min_ps(x, other), _mm512_max_ps(x, other));
}

// A bitonic sequence of 16 (no NaN) sorted descending.
inline __m512 bitonic_merge16(__m512 x) {
  x = bitonic_step<16, 8>(x);
  x = bitonic_step<16, 4>(x);
  x = bitonic_step<16, 2>(x);
  return bitonic_step<16, 1>(x);
}

// 16 floats (no NaN) sorted descending.
inline __m512 sort16(__m512 x) {
  x = bitonic_step<2, 1>(x);
  x = bitonic_step<4, 2>(x);
  x = bitonic_step<4, 1>(x);
  x = bitonic_step<8, 4>(x);
  x = bitonic_step<8, 2>(x);
  x = bitonic_step<8, 1>(x);
  return bitonic_merge16(x);
}

// The lane maxima of the first and of the second half of the 16-wide vectors of s[0..n) (-inf past n) into
// lane_max[0] and [1]: 32 distinct scores or -inf fillers. False where a score is NaN. Two registers, not a
// register array indexed by the half: that one was kept in memory, a store and a reload a vector.
inline bool lane_maxima(const float* s, int64_t n, __m512* lane_max) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 first = minus_inf, second = minus_inf;
  __mmask16 nan = 0;
  const int64_t vectors = (n + 15) / 16, first_half = (vectors + 1) / 2;
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t j0 = 16 * v;
    const __mmask16 live = n - j0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j0)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(minus_inf, live, s + j0);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (v < first_half)
      first = _mm512_max_ps(first, x);
    else
      second = _mm512_max_ps(second, x);
  }
  lane_max[0] = first;
  lane_max[1] = second;
  return nan == 0;
}

// The k-th largest (k <= 16) of the 32 lane maxima: both sorted, the larger of a[l] and b[15 - l] per lane.
inline float kth_lane_maximum(const __m512* lane_max, int64_t k) {
  const __m512 first = sort16(lane_max[0]);
  const __m512 second = _mm512_permutexvar_ps(
      _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), sort16(lane_max[1]));
  alignas(64) float top_maxima[16];
  _mm512_store_ps(top_maxima, bitonic_merge16(_mm512_max_ps(first, second)));
  return top_maxima[k - 1];
}

// The float32 select_topk for k <= 16 and no NaN. Threshold: the lane maxima of the
// first and of the second half of the 16-wide vectors are 32 distinct scores (or -inf
// fillers), so the k-th largest of them, t, has k scores >= t and the top k are among
// the candidates s[j] >= t (about 20 of 128 random scores). They are gathered by
// compress and ranked by all-pairs compares of their (score, index) keys.
// Returns false (nothing written) where it does not apply; then the caller falls back.
bool select_topk_vector(const float* s, int64_t n, int64_t k, float* top_values, int64_t* top_indices) {
  if (k > 16) return false;
  __m512 lane_max[2];
  if (!lane_maxima(s, n, lane_max)) return false;  // a NaN
  const float t = kth_lane_maximum(lane_max, k);
  const __m512 threshold = _mm512_set1_ps(t);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float candidate_values[kMaxRankCandidates + 16];
  alignas(64) int32_t candidate_indices[kMaxRankCandidates + 16];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t count = 0;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 live = n - j0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j0)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, live, s + j0);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, v, threshold, _CMP_GE_OQ);
    // Compress in registers, then a full store: compress straight to memory is slow on AMD.
    _mm512_storeu_ps(candidate_values + count, _mm512_maskz_compress_ps(keep, v));
    _mm512_storeu_si512(candidate_indices + count,
                        _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(lane, _mm512_set1_epi32(int(j0)))));
    count += _mm_popcnt_u32(keep);
    if (count > kMaxRankCandidates) return false;
  }
  alignas(64) uint64_t keys[kMaxRankCandidates];
  alignas(64) int64_t rank[kMaxRankCandidates];
  const int64_t key_vectors = (count + 7) / 8;
  for (int64_t p = 0; p < count; ++p) keys[p] = order_key(candidate_values[p], uint32_t(candidate_indices[p]));
  for (int64_t p = count; p < key_vectors * 8; ++p) keys[p] = 0;
  switch (key_vectors) {
    case 1: key_ranks<1>(keys, count, rank); break;
    case 2: key_ranks<2>(keys, count, rank); break;
    case 3: key_ranks<3>(keys, count, rank); break;
    case 4: key_ranks<4>(keys, count, rank); break;
    case 5: key_ranks<5>(keys, count, rank); break;
    case 6: key_ranks<6>(keys, count, rank); break;
    case 7: key_ranks<7>(keys, count, rank); break;
    default: key_ranks<8>(keys, count, rank); break;
  }
  // Keys are distinct, so ranks are a permutation of 0..count): place every candidate.
  int64_t order[kMaxRankCandidates];
  for (int64_t p = 0; p < count; ++p) order[rank[p]] = p;
  for (int64_t r = 0; r < k; ++r) {
    top_values[r] = candidate_values[order[r]];
    top_indices[r] = candidate_indices[order[r]];
  }
  return true;
}
#endif

// select_topk of float32 scores: the vector path where it applies, else the general one.
void select_topk_float(const float* s, int64_t n, int64_t k, float* top_values, int64_t* top_indices, float* scratch,
                       int64_t* candidates) {
#if defined(__AVX512F__)
  if (select_topk_vector(s, n, k, top_values, top_indices)) return;
#endif
  select_topk(s, n, k, top_values, top_indices, scratch, candidates);
}

// Per-thread work space of select_product_topk for n_keys sub-keys, top-k and score rows
// of `width` entries.
template <typename A>
struct ProductTopkBuffers {
  std::vector<A> top, scratch;  // both halves' top k; select_topk's 2 * n_keys
  std::vector<int64_t> top_index, next, candidates;
#if defined(__AVX2__) && !defined(__AVX512F__)
  std::vector<float> pair_values;  // both halves' candidates (top16_candidates)
  std::vector<int32_t> pair_indices;
#endif

  ProductTopkBuffers(int64_t n_keys, int64_t topk, [[maybe_unused]] int64_t width)
      : top(2 * topk), scratch(2 * n_keys), top_index(2 * topk), next(topk), candidates(n_keys)
#if defined(__AVX2__) && !defined(__AVX512F__)
        , pair_values(2 * (width + 8)), pair_indices(2 * (width + 8))
#endif
  {
  }
};

// The top k slots of one (token, head) from its halves' sub-key scores half_scores[c][0..n_keys):
// both halves' top k, then merge_topk into scores[0..k) and indices[0..k). Each half's row is
// `width` long (width >= n_keys; entries past n_keys are -inf), so that the AVX2 selection can
// read whole vectors where width is a multiple of 8.
template <typename A>
void select_product_topk(const A* const* half_scores, int64_t n_keys, [[maybe_unused]] int64_t width,
                         int64_t topk, ProductTopkBuffers<A>& buffers, A* scores, int64_t* indices) {
  A* top = buffers.top.data();
  int64_t* top_index = buffers.top_index.data();
  bool selected = false;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // Both halves' insertions interleaved: each insertion waits on the one before it in its
  // own list, so two lists keep the core twice as busy.
  if constexpr (std::is_same_v<A, float>) {
    if (topk <= 16 && width % 8 == 0 && width <= std::numeric_limits<int32_t>::max()) {
      float* values[2] = {buffers.pair_values.data(), buffers.pair_values.data() + width + 8};
      int32_t* ids[2] = {buffers.pair_indices.data(), buffers.pair_indices.data() + width + 8};
      const int64_t count[2] = {top16_candidates(half_scores[0], width, topk, values[0], ids[0]),
                                top16_candidates(half_scores[1], width, topk, values[1], ids[1])};
      if (count[0] >= 0 && count[1] >= 0) {
        Top16 best[2];
        for (int64_t p = 0; p < std::max(count[0], count[1]); ++p)
          for (int c = 0; c < 2; ++c)
            if (p < count[c]) best[c].insert(values[c][p], ids[c][p]);
        for (int c = 0; c < 2; ++c) best[c].write(topk, top + c * topk, top_index + c * topk);
        selected = true;
      }
    }
  }
#endif
  for (int64_t c = 0; c < 2 && !selected; ++c) {
    if constexpr (std::is_same_v<A, float>)
      select_topk_float(half_scores[c], n_keys, topk, top + c * topk, top_index + c * topk, buffers.scratch.data(),
                        buffers.candidates.data());
    else
      select_topk(half_scores[c], n_keys, topk, top + c * topk, top_index + c * topk, buffers.scratch.data(),
                  buffers.candidates.data());
  }
  merge_topk(top, top_index, top + topk, top_index + topk, topk, n_keys, buffers.next.data(), scores, indices);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 pre-screen of the sub-key scores (AVX512_BF16 builds, large n_keys): every sub-key is scored with
// bfloat16 inputs and float32 accumulation (vdpbf16ps: 32 multiply-adds an instruction, twice the fp32 FMA's),
// and only the sub-keys that can still be in the top k are scored again exactly, each by the same d-ordered
// chain of fp32 FMAs from 0 as score_tile, so the scores and the selection are those of the fp32 tiles bit for bit.
//
// The bound. For a query half q and sub-key k (half components), s = the fp32 FMA chain, b = the bf16 score:
//  - rounding to bf16 (round to nearest even, 8 significant bits) moves x by at most 2^-8 |x|, or by |x| < 2^-126
//    where the result is subnormal (vdpbf16ps and the conversion may flush those to 0);
//  - products of two bf16 are exact in fp32, |bq bk - q k| <= (2^-7 + 2^-16) |q||k| + 2^-125 (|q| + |k|) and the
//    product flushed below 2^-126;
//  - each accumulation rounds at most twice a pair (half roundings), each off by at most 2^-23 of the partial sum
//    (twice round-to-nearest's 2^-24, whatever the hardware's rounding) plus 2^-126 flushed: at most
//    1.01 half 2^-23 sum |q_d||k_d| + half 2^-126 (half 2^-23 <= 2^-11);
//  - s is off the exact dot product by at most 1.01 half 2^-24 sum |q_d||k_d| (+ half 2^-149 underflow).
// With sum |q_d||k_d| <= ||q|| ||k|| (Cauchy-Schwarz) and sum |q_d| <= sqrt(half) ||q||:
//   |b - s| <= E = ||q|| max_j ||k_j|| (2^-7 + 2^-16 + 2 half 2^-23) + 2^-124 (sqrt(half) (||q|| + max ||k||) + half).
// With T the k-th largest bf16 score, k sub-keys have s >= T - E; a sub-key with b < T - 2E has s < T - E, below
// k others strictly, so it is not in the top k whatever the tie-break: the top k of the sub-keys with b >= T - 2E
// are the top k of all. The norms are summed in double (a factor 1 + 2^-20 covers their rounding) and the
// threshold rounded down to float. Rows with ||q||, max ||k|| or their product above 2^100 (infinities and NaNs
// included) keep the exact scores of every sub-key: no overflow to reason about.
//
// From n_keys = kPrescreenKeys (one thread, 2,048 tokens, 4 heads, half 128; see benchmarks/RESULTS.md) and
// kPrescreenTokens tokens a call: the bf16 keys are made every call (2H x padded x half values). At 1M slots a call
// of 24 tokens took 0.86 ms instead of 0.58 (with the buffers zeroed), calls of 192 and 512 tokens the same time
// with and without the pre-screen, 2,048 tokens 2-9% less.
constexpr int64_t kPrescreenKeys = 512;
constexpr int64_t kPrescreenTokens = 8 * kTokenBlock;
constexpr double kPrescreenLimit = 0x1p100;

// The 16 x 16 block x (row i: x[i]) transposed in place: x[i] lane l becomes old x[l] lane i.
inline void transpose16(__m512 x[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    x[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    x[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    x[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    x[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(x[i + j], x[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(x[i + j], x[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    x[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    x[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// The sub-keys as the pre-screen reads them: words (2H, padded / 16, pairs, 16) 32-bit words for the bf16 tiles,
// word [b, p, e, l] the bf16 of components 2e (low half) and 2e + 1 (high half) of sub-key 16 p + l (0 past
// half); rows (2H, padded, half) fp32, each sub-key's components contiguous for the exact rescoring; and
// max_norm[b], the largest ||k_j|| over the n_keys sub-keys of (head, half) b (padding columns are 0).
struct PrescreenKeys {
  int64_t pairs;
  std::unique_ptr<uint32_t[]> words;  // uninitialised (zeroing them took a third of their making): all written here
  std::unique_ptr<float[]> rows;
  std::vector<double> max_norm;

  PrescreenKeys(const float* keys_t, int64_t blocks, int64_t half, int64_t padded_keys, int threads)
      : pairs((half + 1) / 2), words(new uint32_t[blocks * padded_keys * pairs]),
        rows(new float[blocks * padded_keys * half]), max_norm(blocks) {
    const int64_t panels = padded_keys / 16;
    std::vector<double> panel_norm2(blocks * padded_keys);  // ||k_j||^2 of sub-key j of block b at b * padded + j
    // Interleaves [a0..a15, b0..b15] (cvtne2ps_pbh(b, a)) into [a0, b0, a1, b1, ...].
    alignas(64) uint16_t order[32];
    for (int l = 0; l < 32; ++l) order[l] = static_cast<uint16_t>(l / 2 + 16 * (l % 2));
    const __m512i interleave = _mm512_load_si512(order);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bp = 0; bp < blocks * panels; ++bp) {
      const float* panel = keys_t + bp * half * 16;
      uint32_t* out = words.get() + bp * pairs * 16;
      for (int64_t e = 0; e < pairs; ++e) {
        const __m512 even = _mm512_loadu_ps(panel + 2 * e * 16);
        const __m512 odd = 2 * e + 1 < half ? _mm512_loadu_ps(panel + (2 * e + 1) * 16) : _mm512_setzero_ps();
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
        _mm512_storeu_si512(out + e * 16, _mm512_permutexvar_epi16(interleave, both));
      }
      // Rows: 16 components of the 16 sub-keys at a time, transposed; their squares summed in double by lanes.
      float* row = rows.get() + bp * 16 * half;
      __m512d norm2[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
      for (int64_t d0 = 0; d0 < half; d0 += 16) {
        const int64_t width = std::min<int64_t>(16, half - d0);
        __m512 x[16];
        for (int64_t i = 0; i < 16; ++i) {
          x[i] = i < width ? _mm512_loadu_ps(panel + (d0 + i) * 16) : _mm512_setzero_ps();
          for (int g = 0; g < 2; ++g) {
            const __m512d wide = _mm512_cvtps_pd(g ? _mm512_extractf32x8_ps(x[i], 1) : _mm512_castps512_ps256(x[i]));
            norm2[g] = _mm512_fmadd_pd(wide, wide, norm2[g]);
          }
        }
        transpose16(x);
        const __mmask16 live = width == 16 ? __mmask16(0xffff) : __mmask16((1u << width) - 1);
        for (int64_t l = 0; l < 16; ++l) _mm512_mask_storeu_ps(row + l * half + d0, live, x[l]);
      }
      _mm512_storeu_pd(panel_norm2.data() + bp * 16, norm2[0]);
      _mm512_storeu_pd(panel_norm2.data() + bp * 16 + 8, norm2[1]);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      double largest = 0;
      for (int64_t j = 0; j < padded_keys; ++j) {
        const double norm2 = panel_norm2[b * padded_keys + j];
        largest = norm2 == norm2 ? std::max(largest, norm2) : std::numeric_limits<double>::infinity();
        if (largest == std::numeric_limits<double>::infinity()) break;  // NaN or inf: the pre-screen is off
      }
      max_norm[b] = std::sqrt(largest);
    }
  }
};

// q (half) fp32 as bf16 pairs: word e holds components 2e (low) and 2e + 1 (high), 0 past half.
inline void bf16_pairs(const float* q, int64_t half, uint32_t* words) {
  for (int64_t d0 = 0; d0 < half; d0 += 32) {
    const int64_t left = std::min<int64_t>(32, half - d0);
    const __mmask16 lo = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __mmask16 hi = left >= 32 ? __mmask16(0xffff) : left > 16 ? __mmask16((1u << (left - 16)) - 1) : 0;
    const __m512 a = _mm512_maskz_loadu_ps(lo, q + d0), b = _mm512_maskz_loadu_ps(hi, q + d0 + 16);
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
    const int64_t words_left = (left + 1) / 2;
    _mm512_mask_storeu_epi32(words + d0 / 2, words_left >= 16 ? __mmask16(0xffff) : __mmask16((1u << words_left) - 1),
                             both);
  }
}

// out_r[j] = the bf16 score of q_r and column j for R query rows (bf16 pairs) and the 16 * V columns of V panels
// of kb (panel v: (pairs, 16) words at kb + v * pairs * 16), as score_tile does in fp32.
template <int R, int V>
inline void bf16_score_tile(const uint32_t* const* q, const uint32_t* kb, int64_t pairs, float* const* out) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t e = 0; e < pairs; ++e) {
    __m512bh k[V];
    for (int v = 0; v < V; ++v)
      k[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kb + (v * pairs + e) * 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[r][e])));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b, k[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out[r] + 16 * v, acc[r][v]);
}

template <int R>
inline void bf16_score_rows(const uint32_t* const* q, const uint32_t* kb, int64_t pairs, int64_t padded,
                            float* const* out) {
  for (int64_t j0 = 0; j0 < padded;) {
    float* tile_out[R];
    for (int r = 0; r < R; ++r) tile_out[r] = out[r] + j0;
    const int64_t vectors = std::min<int64_t>(4, (padded - j0) / 16);
    switch (vectors) {
      case 4: bf16_score_tile<R, 4>(q, kb + j0 * pairs, pairs, tile_out); break;
      case 3: bf16_score_tile<R, 3>(q, kb + j0 * pairs, pairs, tile_out); break;
      case 2: bf16_score_tile<R, 2>(q, kb + j0 * pairs, pairs, tile_out); break;
      default: bf16_score_tile<R, 1>(q, kb + j0 * pairs, pairs, tile_out); break;
    }
    j0 += 16 * vectors;
  }
}

template <int R>
void bf16_score_tail(const uint32_t* const* q, int64_t left, const uint32_t* kb, int64_t pairs, int64_t padded,
                     float* const* out) {
  if constexpr (R > 1) {
    if (left < R) return bf16_score_tail<R - 1>(q, left, kb, pairs, padded, out);
  }
  bf16_score_rows<R>(q, kb, pairs, padded, out);
}

// block_scores with bf16 inputs: out[r * padded + j] = the bf16 score of q[r] and sub-key j.
void bf16_block_scores(const uint32_t* const* q, int64_t rows, const uint32_t* kb, int64_t pairs, int64_t padded,
                       float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    float* tile_out[kTileRows];
    const int64_t left = std::min(kTileRows, rows - r0);
    for (int64_t r = 0; r < left; ++r) tile_out[r] = out + (r0 + r) * padded;
    bf16_score_tail<kTileRows>(q + r0, left, kb, pairs, padded, tile_out);
  }
}

// The bound E above for a query half q (half) against sub-keys of largest norm max_norm; +inf where the row
// keeps every exact score (a norm or their product above kPrescreenLimit, or not a number).
inline double prescreen_bound(const float* q, int64_t half, double max_norm) {
  double norm2 = 0;  // in any order: its rounding (below half 2^-53 of it) is in the factor 1 + 2^-20
#pragma omp simd reduction(+ : norm2)
  for (int64_t d = 0; d < half; ++d) norm2 += double(q[d]) * q[d];
  const double norm = std::sqrt(norm2);
  if (!(norm <= kPrescreenLimit && max_norm <= kPrescreenLimit && norm * max_norm <= kPrescreenLimit))
    return std::numeric_limits<double>::infinity();
  const double relative = 0x1p-7 + 0x1p-16 + 2.0 * double(half) * 0x1p-23;
  return (norm * max_norm * relative + 0x1p-124 * (std::sqrt(double(half)) * (norm + max_norm) + double(half))) *
         (1 + 0x1p-20);
}

// out[p] = the fp32 score of q (half) and sub-key ids[p] (rows: (n, half) fp32), p < count <= 16, by the same
// d-ordered chain of FMAs from 0 as score_tile, the candidates in lanes: their rows are read 16 components at a
// time and transposed (a gather of 16 columns of the panel layout took 3x longer on the EPYC VM).
inline void exact_scores16(const float* q, const float* rows, int64_t half, const int32_t* ids, int64_t count,
                           float* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < half; d0 += 16) {
    const int64_t width = std::min<int64_t>(16, half - d0);
    const __mmask16 live = width == 16 ? __mmask16(0xffff) : __mmask16((1u << width) - 1);
    __m512 x[16];
    for (int64_t p = 0; p < 16; ++p)
      x[p] = p < count ? _mm512_maskz_loadu_ps(live, rows + ids[p] * half + d0) : _mm512_setzero_ps();
    transpose16(x);
    for (int64_t i = 0; i < width; ++i) acc = _mm512_fmadd_ps(_mm512_set1_ps(q[d0 + i]), x[i], acc);
  }
  _mm512_storeu_ps(out, acc);
}

// The k-th largest of v[0..m) (k <= m <= 64, no NaN): the smallest value with at most k - 1 values above it.
inline float kth_largest64(const float* v, int64_t m, int64_t k) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t vectors = (m + 15) / 16;
  __m512 x[4];
  __m512i above[4];
  for (int64_t i = 0; i < vectors; ++i) {
    const __mmask16 live = m - 16 * i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (m - 16 * i)) - 1);
    x[i] = _mm512_mask_loadu_ps(minus_inf, live, v + 16 * i);
    above[i] = _mm512_setzero_si512();
  }
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t p = 0; p < m; ++p) {
    const __m512 other = _mm512_set1_ps(v[p]);
    for (int64_t i = 0; i < vectors; ++i)
      above[i] = _mm512_mask_add_epi32(above[i], _mm512_cmp_ps_mask(other, x[i], _CMP_GT_OQ), above[i], one);
  }
  __m512 smallest = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512i within = _mm512_set1_epi32(static_cast<int>(k));
  for (int64_t i = 0; i < vectors; ++i) {
    const __mmask16 live = m - 16 * i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (m - 16 * i)) - 1);
    const __mmask16 top = _mm512_mask_cmplt_epi32_mask(live, above[i], within);
    smallest = _mm512_mask_min_ps(smallest, top, smallest, x[i]);
  }
  return _mm512_reduce_min_ps(smallest);
}

// The largest float <= x - 2 bound (bound >= 0, finite): the pre-screen's threshold below a k-th score x.
inline float threshold_below(float x, double bound) {
  const double wanted = double(x) - 2 * bound;
  float threshold = static_cast<float>(wanted);
  if (double(threshold) > wanted) threshold = std::nextafter(threshold, -std::numeric_limits<float>::infinity());
  return threshold;
}

// One half's top k (sorted, ties: lower index first) of the exact fp32 scores of q (half) against the sub-keys
// rows (n_keys, half), from its bf16 scores b[0..n_keys) and bound E: the sub-keys with b >= T - 2E (T the k-th
// largest b) are rescored exactly (exact_scores16) and ranked as select_topk ranks. T is found without ranking
// every score: t, the k-th largest of the 32 lane maxima (of the first and of the second half of the 16-wide
// vectors: k distinct scores >= t, so t <= T), gives in one pass the scores >= t - 2E (about 40 of 1,024), which
// hold the top k and every candidate; T is the k-th largest of those, and the candidates those >= T - 2E, in index
// order. The candidates are the same as a selection of all n_keys scores gives.
// Returns false (nothing written) where E is infinite or a score is NaN. `ids` and `exact` hold n_keys + 16.
bool prescreened_topk(const float* q, const float* rows, int64_t half, const float* b, int64_t n_keys, double bound,
                      int64_t topk, ProductTopkBuffers<float>& buffers, int32_t* ids, float* exact, float* top_values,
                      int64_t* top_indices) {
  if (!(bound < std::numeric_limits<double>::infinity())) return false;
  __m512 lane_max[2];
  if (!lane_maxima(b, n_keys, lane_max)) return false;  // a NaN
  // Scores >= t - 2E (values into exact, indices into ids), in index order; every score where k > 16.
  const float t = topk <= 16 ? kth_lane_maximum(lane_max, topk) : -std::numeric_limits<float>::infinity();
  const __m512 wide = _mm512_set1_ps(threshold_below(t, bound));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t count = 0;
  for (int64_t j0 = 0; j0 < n_keys; j0 += 16) {
    const __mmask16 live = n_keys - j0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n_keys - j0)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(live, b + j0);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, x, wide, _CMP_GE_OQ);
    // Compress in registers, then a full store: compress straight to memory is slow on AMD.
    _mm512_storeu_ps(exact + count, _mm512_maskz_compress_ps(keep, x));
    _mm512_storeu_si512(ids + count,
                        _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(lane, _mm512_set1_epi32(int(j0)))));
    count += _mm_popcnt_u32(keep);
  }
  if (count < topk) return false;  // not with t <= T; kept as a guard
  float kth;
  if (count <= 64) {
    kth = kth_largest64(exact, count, topk);
  } else {  // many scores near t (ties): the k-th largest by a partial sort of a copy
    float* copy = buffers.scratch.data();
    std::copy(exact, exact + count, copy);
    std::nth_element(copy, copy + topk - 1, copy + count, std::greater<float>());
    kth = copy[topk - 1];
  }
  // The candidates: those >= T - 2E, compacted in place (a store at `kept` <= p0 ends by p0 + 16, past what it
  // overwrites only the lanes just loaded).
  const __m512 narrow = _mm512_set1_ps(threshold_below(kth, bound));
  int64_t kept = 0;
  for (int64_t p0 = 0; p0 < count; p0 += 16) {
    const __mmask16 live = count - p0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - p0)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(live, exact + p0);
    const __m512i j = _mm512_maskz_loadu_epi32(live, ids + p0);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, x, narrow, _CMP_GE_OQ);
    _mm512_storeu_si512(ids + kept, _mm512_maskz_compress_epi32(keep, j));
    kept += _mm_popcnt_u32(keep);
  }
  for (int64_t p0 = 0; p0 < kept; p0 += 16)
    exact_scores16(q, rows, half, ids + p0, std::min<int64_t>(16, kept - p0), exact + p0);
  // Candidates in index order: equal scores keep the lower index first.
  select_topk_float(exact, kept, topk, top_values, top_indices, buffers.scratch.data(), buffers.candidates.data());
  for (int64_t r = 0; r < topk; ++r) top_indices[r] = ids[top_indices[r]];
  return true;
}
#endif

template <typename A>
void topk_select_impl(const A* sub_scores, A* scores, int64_t* indices, int64_t num_tokens, int64_t heads,
                      int64_t n_keys, int64_t topk, int threads) {
#pragma omp parallel num_threads(threads)
  {
    ProductTopkBuffers<A> buffers(n_keys, topk, n_keys);
#pragma omp for schedule(static)
    for (int64_t nh = 0; nh < num_tokens * heads; ++nh) {
      const int64_t n = nh / heads, h = nh % heads;
      const A* half_scores[2] = {sub_scores + (h * 2 * num_tokens + n) * n_keys,
                                 sub_scores + ((h * 2 + 1) * num_tokens + n) * n_keys};
      select_product_topk(half_scores, n_keys, n_keys, topk, buffers, scores + nh * topk, indices + nh * topk);
    }
  }
}

// Row r of a block's query rows as float32: a float32 row itself; a bfloat16 row converted into
// buffer + r * half while the block is in cache. A float32 copy of the whole query before the
// kernel (16 MB written and read at N = 4096) took 1.1 ms of the bf16 lookup's ~13.
inline const float* float_row(const float* row, int64_t, int64_t, float*) { return row; }
inline const float* float_row(const BFloat16* row, int64_t r, int64_t half, float* buffer) {
  float* out = buffer + r * half;
  for (int64_t d = 0; d < half; ++d) out[d] = load(row[d]);
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// topk_forward_float_impl with the pre-screen. The tasks run half-major, then head by head over every token
// block: one (half, head)'s bf16 and fp32 sub-keys (768 KB at n_keys 1,024, half 128) stay in L2 for all its
// blocks, where (block, head) tasks with both halves each brought 1.5 MB back from L3 (the lookup at 1M slots,
// 2,048 tokens, one thread, load 9-11: 59-76 -> 43-58 ms CPU). The first half's top k of every (token, head) is kept
// (first_top, first_index: N x H x k) until the second half's, then merged. A half whose bound is infinite
// (prescreened_topk false) is scored and selected exactly, as select_product_topk selects each half.
template <typename T>
void prescreened_forward(const T* query, const float* keys_t, float* scores, int64_t* indices, int64_t num_tokens,
                         int64_t heads, int64_t half, int64_t n_keys, int64_t padded_keys, int64_t topk, int threads) {
  const int64_t blocks = (num_tokens + kTokenBlock - 1) / kTokenBlock;
  const PrescreenKeys prescreen_keys(keys_t, heads * 2, half, padded_keys, threads);
  const int64_t pairs = (half + 1) / 2;
  const std::unique_ptr<float[]> first_top(new float[num_tokens * heads * topk]);
  const std::unique_ptr<int64_t[]> first_index(new int64_t[num_tokens * heads * topk]);
#pragma omp parallel num_threads(threads)
  {
    // A block's scores of one half: row r at r * padded_keys (uninitialised: every entry read is written first).
    const std::unique_ptr<float[]> block(new float[kTokenBlock * padded_keys]);
    ProductTopkBuffers<float> buffers(n_keys, topk, padded_keys);
    std::vector<float> converted(std::is_same_v<T, float> ? 0 : kTokenBlock * half);  // see float_row
    std::vector<uint32_t> query_words(kTokenBlock * pairs);  // the block's query rows as bf16 pairs
    std::vector<int32_t> candidate_ids(n_keys + 16);
    std::vector<float> candidate_scores(n_keys + 16);
    for (int64_t c = 0; c < 2; ++c) {
#pragma omp for schedule(static)
      for (int64_t task = 0; task < heads * blocks; ++task) {
        const int64_t h = task / blocks, n0 = task % blocks * kTokenBlock;
        const int64_t rows = std::min(kTokenBlock, num_tokens - n0);
        const int64_t key_block = h * 2 + c;
        const float* q[kTokenBlock];
        const uint32_t* words[kTokenBlock];
        for (int64_t r = 0; r < rows; ++r) {
          q[r] = float_row(query + ((n0 + r) * heads + h) * 2 * half + c * half, r, half, converted.data());
          uint32_t* row_words = query_words.data() + r * pairs;
          bf16_pairs(q[r], half, row_words);
          words[r] = row_words;
        }
        bf16_block_scores(words, rows, prescreen_keys.words.get() + key_block * padded_keys * pairs, pairs,
                          padded_keys, block.get());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t nh = (n0 + r) * heads + h;
          float* top = c == 0 ? first_top.get() + nh * topk : buffers.top.data() + topk;
          int64_t* top_index = c == 0 ? first_index.get() + nh * topk : buffers.top_index.data() + topk;
          float* row_scores = block.get() + r * padded_keys;
          if (!prescreened_topk(q[r], prescreen_keys.rows.get() + key_block * padded_keys * half, half, row_scores,
                                n_keys, prescreen_bound(q[r], half, prescreen_keys.max_norm[key_block]), topk, buffers,
                                candidate_ids.data(), candidate_scores.data(), top, top_index)) {
            block_scores(q + r, 1, keys_t + key_block * half * padded_keys, half, padded_keys, row_scores);
            select_topk_float(row_scores, n_keys, topk, top, top_index, buffers.scratch.data(),
                              buffers.candidates.data());
          }
          if (c == 1)
            merge_topk(first_top.get() + nh * topk, first_index.get() + nh * topk, top, top_index, topk, n_keys,
                       buffers.next.data(), scores + nh * topk, indices + nh * topk);
        }
      }
    }
  }
}
#endif

template <typename T>
void topk_forward_float_impl(const T* query, const float* keys_t, float* scores, int64_t* indices, int64_t num_tokens,
                             int64_t heads, int64_t half, int64_t n_keys, int64_t padded_keys, int64_t topk,
                             int threads) {
  const int64_t blocks = (num_tokens + kTokenBlock - 1) / kTokenBlock;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (n_keys >= kPrescreenKeys && num_tokens >= kPrescreenTokens && half <= 4096)
    return prescreened_forward(query, keys_t, scores, indices, num_tokens, heads, half, n_keys, padded_keys, topk,
                               threads);
#endif
#pragma omp parallel num_threads(threads)
  {
    // Both halves' scores of a block of tokens: half c of row r at (c * kTokenBlock + r) * padded_keys.
    // Uninitialised (a decoded token at 1M slots would zero 196 KB a call): every entry read is written first.
    const std::unique_ptr<float[]> block(new float[2 * kTokenBlock * padded_keys]);
    ProductTopkBuffers<float> buffers(n_keys, topk, padded_keys);
    std::vector<float> converted(std::is_same_v<T, float> ? 0 : 2 * kTokenBlock * half);  // see float_row
    // One (block, head) a task: a few decoded tokens still spread their heads over the threads.
#pragma omp for schedule(static)
    for (int64_t task = 0; task < blocks * heads; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const int64_t n0 = b * kTokenBlock, rows = std::min(kTokenBlock, num_tokens - n0);
      const float* q[2][kTokenBlock];
      for (int64_t c = 0; c < 2; ++c)
        for (int64_t r = 0; r < rows; ++r)
          q[c][r] = float_row(query + ((n0 + r) * heads + h) * 2 * half + c * half, r, half,
                              converted.data() + c * kTokenBlock * half);
      // Exact scores of rows [r0, r0 + count) of half c; the padding columns' scores (0) become -inf, never selected.
      auto exact_scores = [&](int64_t c, int64_t r0, int64_t count) {
        float* out = block.get() + (c * kTokenBlock + r0) * padded_keys;
        block_scores(q[c] + r0, count, keys_t + (h * 2 + c) * half * padded_keys, half, padded_keys, out);
        if (n_keys < padded_keys)
          for (int64_t r = 0; r < count; ++r)
            std::fill(out + r * padded_keys + n_keys, out + (r + 1) * padded_keys,
                      -std::numeric_limits<float>::infinity());
      };
      for (int64_t c = 0; c < 2; ++c) exact_scores(c, 0, rows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t nh = (n0 + r) * heads + h;
        const float* half_scores[2] = {block.get() + r * padded_keys,
                                       block.get() + (kTokenBlock + r) * padded_keys};
        select_product_topk(half_scores, n_keys, padded_keys, topk, buffers, scores + nh * topk,
                            indices + nh * topk);
      }
    }
  }
}

// Tokens per chunk of the top-k backward's key gradient, and the most chunks (each holds a
// copy of the key gradient, zeroed and added up again): 4 chunks, 2 MB of copies at N = 4096 and
// the paper's shape, enough to keep a few threads busy on a pass that takes milliseconds.
constexpr int64_t kKeyGradChunkTokens = 1024;
constexpr int64_t kKeyGradMaxChunks = 8;

// slot / n_keys without a 64-bit division (the hottest instruction of the sums below under perf,
// one per pair): a floating-point estimate, corrected by one; exact for slots below 2**52.
inline int64_t first_sub_key(int64_t slot, int64_t n_keys, double inverse) {
  int64_t i = static_cast<int64_t>(static_cast<double>(slot) * inverse);
  if (i * n_keys > slot) --i;
  else if ((i + 1) * n_keys <= slot) ++i;
  return i;
}

// Gradients of the top-k scores with respect to query and keys, reading only the sub-keys the
// k pairs use (no dense (N, H, n_keys) buffers).
//
// First, for each query half u = (n * heads + h) * 2 + c, the score gradients of its k pairs
// summed per distinct sub-key, in order of first appearance: sub_count[u] sub-keys
// sub_id[u * topk + j] with gradients sub_grad[u * topk + j]. The k best pairs of a token and head
// share sub-keys (about 6.7 distinct of 16 per half on random queries at the paper's shape), so
// the passes after it do one row update per distinct sub-key instead of one per pair: both
// gradients at N = 4096 on one core of the project's VM, 14.7-15.1 ms -> 11.4-11.9 ms. The sums take
// no branches (a per-thread map from sub-key to position, reset after use): a linear search was
// slower than no sums at all. (Passes ordered by (head, half) instead of by token were slower too.)
//
// grad_query rows are owned by tokens. grad_keys is summed per chunk of tokens in token order,
// then over the chunks in order, so results do not depend on the thread count.
template <typename T>
void topk_backward_impl(const typename Accumulate<T>::type* grad_scores, const T* query, const T* keys,
                        const int64_t* indices, typename Accumulate<T>::type* grad_query,
                        typename Accumulate<T>::type* grad_keys, int64_t num_tokens, int64_t heads, int64_t half,
                        int64_t n_keys, int64_t topk, int threads) {
  using A = typename Accumulate<T>::type;
  const int64_t pairs = num_tokens * heads, blocks = heads * 2, halves = pairs * 2;
  std::vector<int32_t> sub_id(halves * topk), position(2 * threads * n_keys, -1);
  std::vector<A> sub_grad(halves * topk);
  std::vector<int32_t> sub_count(halves);
  const double inverse = 1.0 / static_cast<double>(n_keys);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t nh = 0; nh < pairs; ++nh) {
    int32_t* pos = position.data() + 2 * omp_get_thread_num() * n_keys;
    A* grad = sub_grad.data() + 2 * nh * topk;
    int32_t* id = sub_id.data() + 2 * nh * topk;
    int32_t count[2] = {0, 0};
    std::fill(grad, grad + 2 * topk, A(0));
    for (int64_t r = 0; r < topk; ++r) {
      const int64_t slot = indices[nh * topk + r], i = first_sub_key(slot, n_keys, inverse);
      const int32_t key[2] = {static_cast<int32_t>(i), static_cast<int32_t>(slot - i * n_keys)};
      for (int64_t c = 0; c < 2; ++c) {
        const int32_t seen = pos[c * n_keys + key[c]];
        const int32_t j = seen < 0 ? count[c] : seen;
        pos[c * n_keys + key[c]] = j;
        id[c * topk + j] = key[c];
        grad[c * topk + j] += grad_scores[nh * topk + r];
        count[c] += seen < 0;
      }
    }
    for (int64_t c = 0; c < 2; ++c) {
      for (int32_t j = 0; j < count[c]; ++j) pos[c * n_keys + id[c * topk + j]] = -1;
      sub_count[2 * nh + c] = count[c];
    }
  }
  if (grad_query != nullptr) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t u = 0; u < halves; ++u) {
      const int64_t b = u % blocks;  // (head, half) of u
      A* out = grad_query + u * half;
      std::fill(out, out + half, A(0));
      for (int32_t j = 0; j < sub_count[u]; ++j) {
        const A g = sub_grad[u * topk + j];
        const T* key = keys + (b * n_keys + sub_id[u * topk + j]) * half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) out[d] += g * load(key[d]);
      }
    }
  }
  if (grad_keys == nullptr) return;
  // Each chunk of tokens sums its pairs into its own copy of grad_keys (512 KB at the paper's
  // shape, about L2), reading the query once in order; the copies are then added in chunk order.
  // Grouping the pairs by sub-key instead read a query half-row at random per pair (268 MB from
  // L3 at N = 4096). Chunks depend on N only, so results do not depend on the thread count.
  const int64_t key_elems = blocks * n_keys * half;
  const int64_t chunks = std::clamp<int64_t>(num_tokens / kKeyGradChunkTokens, 1, kKeyGradMaxChunks);
  const int64_t chunk_tokens = (num_tokens + chunks - 1) / chunks;
  std::unique_ptr<A[]> partial(new A[chunks * key_elems]);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    A* part = partial.get() + chunk * key_elems;
    std::fill(part, part + key_elems, A(0));  // by the thread that sums into it
    const int64_t last = std::min(num_tokens, (chunk + 1) * chunk_tokens) * blocks;
    for (int64_t u = chunk * chunk_tokens * blocks; u < last; ++u) {
      const int64_t b = u % blocks;  // (head, half) of u
      const T* q = query + u * half;
      for (int32_t j = 0; j < sub_count[u]; ++j) {
        const A g = sub_grad[u * topk + j];
        A* out = part + (b * n_keys + sub_id[u * topk + j]) * half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) out[d] += g * load(q[d]);
      }
    }
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t e = 0; e < key_elems; ++e) {
    A sum = 0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) sum += partial[chunk * key_elems + e];
    grad_keys[e] = sum;
  }
}

}  // namespace

void topk_select(DType dtype, const void* sub_scores, void* scores, int64_t* indices, int64_t num_tokens,
                 int64_t heads, int64_t n_keys, int64_t topk, int threads) {
  if (dtype == DType::Float64)
    topk_select_impl(static_cast<const double*>(sub_scores), static_cast<double*>(scores), indices, num_tokens, heads,
                     n_keys, topk, threads);
  else
    topk_select_impl(static_cast<const float*>(sub_scores), static_cast<float*>(scores), indices, num_tokens, heads,
                     n_keys, topk, threads);
}

void topk_forward_float(DType dtype, const void* query, const float* keys_t, float* scores, int64_t* indices,
                        int64_t num_tokens, int64_t heads, int64_t half, int64_t n_keys, int64_t padded_keys,
                        int64_t topk, int threads) {
  if (dtype == DType::BFloat16)
    topk_forward_float_impl(static_cast<const BFloat16*>(query), keys_t, scores, indices, num_tokens, heads, half,
                            n_keys, padded_keys, topk, threads);
  else
    topk_forward_float_impl(static_cast<const float*>(query), keys_t, scores, indices, num_tokens, heads, half,
                            n_keys, padded_keys, topk, threads);
}

void topk_backward(DType dtype, const void* grad_scores, const void* query, const void* keys, const int64_t* indices,
                   void* grad_query, void* grad_keys, int64_t num_tokens, int64_t heads, int64_t half, int64_t n_keys,
                   int64_t topk, int threads) {
  SMF_CPU_DISPATCH(dtype, topk_backward_impl(static_cast<const typename Accumulate<T>::type*>(grad_scores),
                                             static_cast<const T*>(query), static_cast<const T*>(keys), indices,
                                             static_cast<typename Accumulate<T>::type*>(grad_query),
                                             static_cast<typename Accumulate<T>::type*>(grad_keys), num_tokens, heads,
                                             half, n_keys, topk, threads));
}

}  // namespace smf::cpu
