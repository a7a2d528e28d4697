// Element types the kernels are compiled for. Pure C++ (no torch headers) so the
// CPU and CUDA kernel files build without ATen; bindings.cpp maps torch dtypes here.
#pragma once

namespace smf {

// Storage type of the large tensors (query/keys, values, grad_out). Accumulation,
// scores, weights and gradients are float64 for Float64 and float32 otherwise.
enum class DType { Float32, Float64, BFloat16 };

}  // namespace smf
