// What the CPU kernels of every op share (see cpu_kernels.h): bfloat16 bits and their rounding, the
// accumulation type, vector loads, and the dtype dispatch. Each op's kernels live in their own file
// (cpu_topk.cpp, cpu_gather.cpp, cpu_silu_mul.cpp, cpu_row_adamw.cpp) so that the build compiles them in parallel.
// Each parallel loop gives every thread a disjoint set of output rows, so results never depend on scheduling.
#pragma once

#include "cpu_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// x rounded to T and back (the rounding torch makes when it stores an intermediate in T).
template <typename T>
inline typename Accumulate<T>::type rounded(typename Accumulate<T>::type x) {
  T out;
  store(x, &out);
  return load(out);
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 floats from 8 float32 or bfloat16 values (also in AVX-512 builds: the gather's forward tile).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif
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

}  // namespace smf::cpu
