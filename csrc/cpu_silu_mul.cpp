// CPU kernels of the gated read silu(gate) * read and its backward (see cpu_kernels.h).
#include "cpu_common.h"

namespace smf::cpu {
namespace {

// ---- silu(gate) * read, elementwise.

// Values per OpenMP work item of the elementwise ops (a multiple of 8).
constexpr int64_t kElementBlock = 4096;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 1 / (1 + exp(-x)) for 8 floats. exp(y): y = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes'
// degree-6 polynomial (about 1 ulp), 2^n from the exponent bits; y above 88.38 gives +inf and
// below -87.34 gives 0, so sigmoid(-inf) = 0 and sigmoid(+inf) = 1 as in torch; NaN stays NaN.
inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f), high = _mm256_set1_ps(88.3762626647949f);
  const __m256 low = _mm256_set1_ps(-87.3365447504019f);
  const __m256 y = _mm256_sub_ps(_mm256_setzero_ps(), x);
  const __m256 clamped = _mm256_min_ps(high, _mm256_max_ps(low, y));  // max/min return a NaN y
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _mm256_cmp_ps(y, high, _CMP_GT_OQ));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(y, low, _CMP_LT_OQ));
  return _mm256_div_ps(one, _mm256_add_ps(one, e));
}

inline void store8(__m256 v, float* out) { _mm256_storeu_ps(out, v); }
inline void store8(__m256 v, BFloat16* out) {
  alignas(32) float values[8];
  _mm256_store_ps(values, v);
  for (int i = 0; i < 8; ++i) store(values[i], out + i);
}
#endif

template <typename A>
inline A sigmoid(A x) {
  return A(1) / (A(1) + std::exp(-x));
}

template <typename T>
void silu_mul_forward_impl(const T* gate, const T* read, T* out, int64_t n, int threads) {
  using A = typename Accumulate<T>::type;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < n; start += kElementBlock) {
    const int64_t end = std::min(n, start + kElementBlock);
    int64_t i = start;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if constexpr (std::is_same_v<A, float>) {
      for (; i + 8 <= end; i += 8) {
        const __m256 x = load8(gate + i);
        store8(_mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(x)), load8(read + i)), out + i);
      }
    }
#endif
    for (; i < end; ++i) {
      const A x = load(gate[i]);
      store(x * sigmoid(x) * load(read[i]), out + i);
    }
  }
}

template <typename T>
void silu_mul_backward_impl(const T* grad, const T* gate, const T* read, T* grad_gate, T* grad_read, int64_t n,
                            int threads) {
  using A = typename Accumulate<T>::type;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t start = 0; start < n; start += kElementBlock) {
    const int64_t end = std::min(n, start + kElementBlock);
    int64_t i = start;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if constexpr (std::is_same_v<A, float>) {
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= end; i += 8) {
        const __m256 x = load8(gate + i), g = load8(grad + i), s = sigmoid8(x);
        store8(_mm256_mul_ps(g, _mm256_mul_ps(x, s)), grad_read + i);
        const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(x, _mm256_sub_ps(one, s), one));
        store8(_mm256_mul_ps(_mm256_mul_ps(g, load8(read + i)), slope), grad_gate + i);
      }
    }
#endif
    for (; i < end; ++i) {
      const A x = load(gate[i]), g = load(grad[i]), s = sigmoid(x);
      store(g * (x * s), grad_read + i);
      store(g * load(read[i]) * (s * (A(1) + x * (A(1) - s))), grad_gate + i);
    }
  }
}

}  // namespace

void silu_mul_forward(DType dtype, const void* gate, const void* read, void* out, int64_t n, int threads) {
  SMF_CPU_DISPATCH(dtype, silu_mul_forward_impl(static_cast<const T*>(gate), static_cast<const T*>(read),
                                                static_cast<T*>(out), n, threads));
}

void silu_mul_backward(DType dtype, const void* grad, const void* gate, const void* read, void* grad_gate,
                       void* grad_read, int64_t n, int threads) {
  SMF_CPU_DISPATCH(dtype, silu_mul_backward_impl(static_cast<const T*>(grad), static_cast<const T*>(gate),
                                                 static_cast<const T*>(read), static_cast<T*>(grad_gate),
                                                 static_cast<T*>(grad_read), n, threads));
}

}  // namespace smf::cpu
