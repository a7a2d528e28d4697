// Python bindings: torch tensors in, kernel launches out. smf_kernels.ops validates
// arguments for its users, but the extension never trusts its inputs: every entry point
// first checks what the kernels rely on (ranks, shapes, dtypes, devices and, for CPU
// tensors, index ranges; CUDA index ranges are asserted on the device by smf_kernels.ops),
// then makes tensors contiguous, runs float16 through float32 and calls the kernels.
// On CPU, float32 top-k runs fused in the kernels (scores and selection a block of tokens at a time);
// float64 gets its sub-key scores from at::bmm (MKL) and the kernel selects.
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_output_pool.h"
#ifdef SMF_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_kernels.h"
#endif

namespace {

// Half precision has no kernels of its own: it runs as float32.
at::Tensor kernel_input(const at::Tensor& t) {
  return (t.scalar_type() == at::kHalf ? t.to(at::kFloat) : t).contiguous();
}

smf::DType kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return smf::DType::Float32;
    case at::kDouble:
      return smf::DType::Float64;
    case at::kBFloat16:
      return smf::DType::BFloat16;
    default:
      TORCH_CHECK(false, "smf_kernels ext: unsupported dtype ", t.scalar_type(),
                  " (expected float32, float64, bfloat16 or float16)");
  }
}

at::ScalarType accumulation_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ---- Input validation: a bad call raises (a Python RuntimeError naming the argument) before any
// kernel touches memory.

// Numbers and shapes in messages are formatted by std::to_string, not by std::ostream's numeric
// insertion: built by the g++ of the lent H100 image (torch 2.11), the extension's own copy of that
// insertion segfaulted while formatting a message, so a bad input crashed the process instead of raising.
std::string text(int64_t value) { return std::to_string(value); }

std::string text(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

void check_rank(const at::Tensor& t, const char* name, int64_t ndim, const char* shape_doc) {
  TORCH_CHECK(t.defined(), "smf_kernels ext: ", name, " must be a tensor of shape ", shape_doc);
  TORCH_CHECK(t.dim() == ndim, "smf_kernels ext: ", name, " must have shape ", shape_doc, " (", text(ndim),
              " dims), got ", text(t.sizes()));
}

void check_float(const at::Tensor& t, const char* name) {
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kDouble || type == at::kBFloat16 || type == at::kHalf,
              "smf_kernels ext: ", name, " must be float32, float64, bfloat16 or float16, got ", type);
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected) {
  TORCH_CHECK(t.scalar_type() == expected, "smf_kernels ext: ", name, " must have dtype ", expected, ", got ",
              t.scalar_type());
}

void check_device(const at::Tensor& t, const char* name, const at::Tensor& reference, const char* reference_name) {
  TORCH_CHECK(t.device() == reference.device(), "smf_kernels ext: ", name, " is on ", t.device(), " but ",
              reference_name, " is on ", reference.device());
}

// Every entry of the int64 tensor t lies in [0, upper). Checked on the host for CPU tensors.
void check_index_range(const at::Tensor& t, const char* name, int64_t upper) {
  if (t.numel() == 0 || !t.is_cpu()) return;
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  const auto [low, high] = std::minmax_element(p, p + c.numel());
  TORCH_CHECK(*low >= 0 && *high < upper, "smf_kernels ext: ", name, " must lie in [0, ", text(upper),
              "), got values in [", text(*low), ", ", text(*high), "]");
}

// The gather's reads: indices (N, L) int64 in [0, num_rows) and weights (N, L) float, on one device.
void check_reads(const at::Tensor& indices, const at::Tensor& weights, int64_t num_rows) {
  check_rank(indices, "indices", 2, "(N, L)");
  check_dtype(indices, "indices", at::kLong);
  check_rank(weights, "weights", 2, "(N, L)");
  check_float(weights, "weights");
  TORCH_CHECK(weights.sizes() == indices.sizes(), "smf_kernels ext: weights must have the shape of indices ",
              text(indices.sizes()), ", got ", text(weights.sizes()));
  check_device(weights, "weights", indices, "indices");
  check_index_range(indices, "indices", num_rows);
}

// update_rows (T,) int64: distinct rows in [0, num_rows), on reference's device.
void check_update_rows(const at::Tensor& rows, int64_t num_rows, const at::Tensor& reference,
                       const char* reference_name) {
  check_rank(rows, "update_rows", 1, "(T,)");
  check_dtype(rows, "update_rows", at::kLong);
  check_device(rows, "update_rows", reference, reference_name);
  check_index_range(rows, "update_rows", num_rows);
  if (rows.is_cpu() && rows.numel() > 1) {
    const at::Tensor sorted = std::get<0>(rows.sort());
    TORCH_CHECK(!sorted.narrow(0, 1, rows.numel() - 1).eq(sorted.narrow(0, 0, rows.numel() - 1)).any().item<bool>(),
                "smf_kernels ext: update_rows must hold distinct rows");
  }
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& indices, int64_t dim) {
  check_rank(grad_out, "grad_out", 2, "(N, D)");
  check_float(grad_out, "grad_out");
  TORCH_CHECK(grad_out.size(0) == indices.size(0) && grad_out.size(1) == dim,
              "smf_kernels ext: grad_out must have shape (N, D) = (", text(indices.size(0)), ", ", text(dim),
              "), got ", text(grad_out.sizes()));
  check_device(grad_out, "grad_out", indices, "indices");
}

#ifdef SMF_WITH_CUDA
// Runs cpu_call (it may use `threads`) or, for a CUDA tensor, cuda_call (it may use
// `stream`, the current stream of the tensor's device) and checks its launch status.
#define SMF_RUN(tensor, cpu_call, cuda_call)                                  \
  if ((tensor).is_cuda()) {                                                   \
    const c10::cuda::CUDAGuard device_guard((tensor).device());              \
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();             \
    C10_CUDA_CHECK(cuda_call);                                                \
  } else {                                                                    \
    const int threads = at::get_num_threads();                                \
    cpu_call;                                                                 \
  }
#else
#define SMF_RUN(tensor, cpu_call, cuda_call)                                                          \
  TORCH_CHECK((tensor).is_cpu(), "smf_kernels ext was built without CUDA kernels; got a tensor on ", \
              (tensor).device());                                                                     \
  {                                                                                                   \
    const int threads = at::get_num_threads();                                                        \
    cpu_call;                                                                                         \
  }
#endif

// keys (heads, 2, n_keys, key_dim // 2) against query (N, heads, key_dim) and topk.
void check_topk(const at::Tensor& query, const at::Tensor& keys, int64_t topk) {
  check_rank(query, "query", 3, "(N, heads, key_dim)");
  check_float(query, "query");
  check_rank(keys, "keys", 4, "(heads, 2, n_keys, key_dim // 2)");
  check_dtype(keys, "keys", query.scalar_type());
  check_device(keys, "keys", query, "query");
  TORCH_CHECK(query.size(2) % 2 == 0, "smf_kernels ext: query's key_dim must be even, got ", text(query.size(2)));
  TORCH_CHECK(keys.size(0) == query.size(1) && keys.size(1) == 2 && keys.size(3) == query.size(2) / 2,
              "smf_kernels ext: keys must have shape (heads, 2, n_keys, key_dim // 2) = (", text(query.size(1)), ", 2, n_keys, ",
              text(query.size(2) / 2), "), got ", text(keys.sizes()));
  TORCH_CHECK(topk >= 1 && topk <= keys.size(2), "smf_kernels ext: topk must lie in [1, n_keys=", text(keys.size(2)),
              "], got ", text(topk));
}

// float32 top-k on CPU runs fused where the kernels have vector score tiles (AVX-512, AVX2 with FMA): the
// scores of a block of tokens selected while in cache. On the project's AVX2 VM (2 threads, N = 4096,
// paper shape) the fp32 lookup took 0.67-0.77x the time of at::bmm plus the selection.
bool fused_float_topk(const at::Tensor& keys) {
  return keys.is_cpu() && accumulation_type(keys) == at::kFloat && smf::cpu::kFusedTopkFloat;
}

int64_t padded_sub_keys(int64_t n_keys) { return (n_keys + 15) / 16 * 16; }

// The keys as topk_forward's kernels read them, for keys (H, 2, n_keys, half): CUDA: the keys themselves
// (float16 as float32); CPU fused float32: the sub-keys zero-padded to a multiple of 16 and transposed in
// panels of 16, (2H, padded / 16, half, 16) float32 (smf::cpu::topk_forward_float); CPU otherwise:
// (2H, n_keys, half) in the accumulation dtype (the GEMM's right operand, transposed there).
// Shape and dtype of that layout, without building it.
std::pair<std::vector<int64_t>, at::ScalarType> key_layout_spec(const at::Tensor& keys) {
  const int64_t heads = keys.size(0), n_keys = keys.size(2), half = keys.size(3);
  if (!keys.is_cpu())
    return {keys.sizes().vec(), keys.scalar_type() == at::kHalf ? at::kFloat : keys.scalar_type()};
  if (fused_float_topk(keys)) return {{heads * 2, padded_sub_keys(n_keys) / 16, half, 16}, at::kFloat};
  return {{heads * 2, n_keys, half}, accumulation_type(keys)};
}

at::Tensor key_layout(const at::Tensor& keys) {
  const int64_t heads = keys.size(0), n_keys = keys.size(2), half = keys.size(3);
  if (!keys.is_cpu()) return kernel_input(keys);
  if (fused_float_topk(keys)) {
    const int64_t padded_keys = padded_sub_keys(n_keys);
    at::Tensor padded = at::zeros({heads * 2, padded_keys, half}, keys.options().dtype(at::kFloat));
    padded.narrow(1, 0, n_keys).copy_(keys.to(at::kFloat).reshape({heads * 2, n_keys, half}));
    return padded.reshape({heads * 2, padded_keys / 16, 16, half}).transpose(2, 3).contiguous();
  }
  return keys.to(accumulation_type(keys)).reshape({heads * 2, n_keys, half}).contiguous();
}

// The layout of keys for topk_forward, built once by the caller and handed to every later lookup with these keys
// (smf_kernels.ops.KeyLayoutCache): at one token, rebuilding it took about half of a 1M-slot lookup.
at::Tensor prepare_topk_keys(const at::Tensor& keys) {
  check_rank(keys, "keys", 4, "(heads, 2, n_keys, key_dim // 2)");
  check_float(keys, "keys");
  TORCH_CHECK(keys.size(1) == 2, "smf_kernels ext: keys must have shape (heads, 2, n_keys, key_dim // 2), got ",
              text(keys.sizes()));
  return key_layout(keys);
}

// A layout handed in: that of keys (key_layout_spec), contiguous, on keys' device. Its entries are the caller's
// word (prepare_topk_keys of these keys); its shape, dtype and device are what the kernels read through.
void check_key_layout(const at::Tensor& layout, const at::Tensor& keys) {
  const auto [sizes, dtype] = key_layout_spec(keys);
  TORCH_CHECK(layout.defined() && layout.sizes() == at::IntArrayRef(sizes) && layout.scalar_type() == dtype,
              "smf_kernels ext: key_layout must be prepare_topk_keys(keys): shape ", text(sizes), " ", dtype,
              ", got ", layout.defined() ? text(layout.sizes()) : std::string("None"), " ",
              layout.defined() ? layout.scalar_type() : dtype);
  check_device(layout, "key_layout", keys, "keys");
  TORCH_CHECK(layout.is_contiguous(), "smf_kernels ext: key_layout must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> topk_forward(const at::Tensor& query, const at::Tensor& keys, int64_t topk,
                                                std::optional<at::Tensor> key_layout_in) {
  check_topk(query, keys, topk);
  if (key_layout_in.has_value()) check_key_layout(*key_layout_in, keys);
  const at::Tensor layout = key_layout_in.has_value() ? *key_layout_in : key_layout(keys);
  const int64_t num_tokens = query.size(0), heads = query.size(1), key_dim = query.size(2), n_keys = keys.size(2);
  const at::ScalarType acc = accumulation_type(query);
  at::Tensor scores = at::empty({num_tokens, heads, topk}, query.options().dtype(acc));
  at::Tensor indices = at::empty({num_tokens, heads, topk}, query.options().dtype(at::kLong));
#ifdef SMF_WITH_CUDA
  if (query.is_cuda()) {  // one fused kernel: sub-key scores, both top-k, the merge
    const at::Tensor q = kernel_input(query);
    const c10::cuda::CUDAGuard device_guard(query.device());
    C10_CUDA_CHECK(smf::cuda::topk_forward(kernel_dtype(q), q.const_data_ptr(), layout.const_data_ptr(),
                                           scores.data_ptr(), indices.data_ptr<int64_t>(), num_tokens, heads, key_dim,
                                           n_keys, topk, c10::cuda::getCurrentCUDAStream()));
    return {scores, indices};
  }
#endif
  TORCH_CHECK(query.is_cpu(), "smf_kernels ext was built without CUDA kernels; got a tensor on ", query.device());
  if (fused_float_topk(keys)) {
    const at::Tensor q = kernel_input(query);  // bfloat16 stays: the kernel converts a block's rows
    smf::cpu::topk_forward_float(kernel_dtype(q), q.const_data_ptr(), layout.const_data_ptr<float>(),
                                 scores.data_ptr<float>(), indices.data_ptr<int64_t>(), num_tokens, heads,
                                 key_dim / 2, n_keys, padded_sub_keys(n_keys), topk, at::get_num_threads());
    return {scores, indices};
  }
  // Sub-key scores by one batched GEMM: (2H, N, half) x (2H, half, n_keys) -> (2H, N, n_keys).
  const at::Tensor q = query.to(acc).reshape({num_tokens, heads * 2, key_dim / 2}).transpose(0, 1);
  const at::Tensor sub_scores = at::bmm(q, layout.transpose(1, 2)).contiguous();
  smf::cpu::topk_select(acc == at::kDouble ? smf::DType::Float64 : smf::DType::Float32, sub_scores.const_data_ptr(),
                        scores.data_ptr(), indices.data_ptr<int64_t>(), num_tokens, heads, n_keys, topk,
                        at::get_num_threads());
  return {scores, indices};
}

at::Tensor gather_forward(const at::Tensor& values_in, const at::Tensor& indices_in, const at::Tensor& weights_in,
                          std::optional<at::Tensor> counts_in, std::optional<at::Tensor> valid_in) {
  check_rank(values_in, "values", 2, "(M, D)");
  check_float(values_in, "values");
  check_device(indices_in, "indices", values_in, "values");
  check_reads(indices_in, weights_in, values_in.size(0));
  if (counts_in.has_value()) {
    check_rank(*counts_in, "counts", 1, "(M,)");
    check_dtype(*counts_in, "counts", at::kLong);
    TORCH_CHECK(counts_in->size(0) == values_in.size(0), "smf_kernels ext: counts must have shape (M,) = (",
                text(values_in.size(0)), ",), got ", text(counts_in->sizes()));
    check_device(*counts_in, "counts", values_in, "values");
  }
  if (valid_in.has_value()) {
    TORCH_CHECK(counts_in.has_value(), "smf_kernels ext: valid needs counts");
    check_rank(*valid_in, "valid", 1, "(N,)");
    check_dtype(*valid_in, "valid", at::kBool);
    TORCH_CHECK(valid_in->size(0) == indices_in.size(0), "smf_kernels ext: valid must have shape (N,) = (",
                text(indices_in.size(0)), ",), got ", text(valid_in->sizes()));
    check_device(*valid_in, "valid", values_in, "values");
  }
  const at::Tensor values = kernel_input(values_in), indices = indices_in.contiguous();
  const at::Tensor weights = weights_in.to(accumulation_type(values)).contiguous();
  // counts is updated in place: a non-contiguous one is updated through a copy.
  at::Tensor counts = counts_in.has_value() ? counts_in->contiguous() : at::Tensor();
  const at::Tensor valid = valid_in.has_value() ? valid_in->contiguous() : at::Tensor();
  int64_t* counts_ptr = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  const bool* valid_ptr = valid.defined() ? valid.const_data_ptr<bool>() : nullptr;
  const int64_t num_tokens = indices.size(0), per_token = indices.size(1), dim = values.size(1);
  at::Tensor out = smf::cpu::pooled_empty({num_tokens, dim}, values.options());
  const smf::DType dtype = kernel_dtype(values);
  SMF_RUN(values,
          smf::cpu::gather_forward(dtype, values.const_data_ptr(), indices.const_data_ptr<int64_t>(),
                                   weights.const_data_ptr(), counts_ptr, valid_ptr, out.data_ptr(), values.size(0),
                                   num_tokens, per_token, dim, threads),
          smf::cuda::gather_forward(dtype, values.const_data_ptr(), indices.const_data_ptr<int64_t>(),
                                    weights.const_data_ptr(), counts_ptr, valid_ptr, out.data_ptr(), num_tokens,
                                    per_token, dim, stream));
  if (counts_in.has_value() && !counts.is_same(*counts_in)) counts_in->copy_(counts);
  return out.to(values_in.scalar_type());
}

at::Tensor gather_backward_weights(const at::Tensor& grad_out_in, const at::Tensor& values_in,
                                   const at::Tensor& indices_in) {
  check_rank(values_in, "values", 2, "(M, D)");
  check_float(values_in, "values");
  check_device(indices_in, "indices", values_in, "values");
  check_rank(indices_in, "indices", 2, "(N, L)");
  check_dtype(indices_in, "indices", at::kLong);
  check_index_range(indices_in, "indices", values_in.size(0));
  check_grad_out(grad_out_in, indices_in, values_in.size(1));
  at::Tensor values = kernel_input(values_in), grad_out = kernel_input(grad_out_in);
  if (grad_out.scalar_type() != values.scalar_type()) {  // mixed dtypes: both in values' accumulation dtype
    const at::ScalarType common = accumulation_type(values);
    values = values.to(common);
    grad_out = grad_out.to(common);
  }
  const at::Tensor indices = indices_in.contiguous();
  const int64_t num_tokens = indices.size(0), per_token = indices.size(1), dim = values.size(1);
  at::Tensor grad_weights = at::empty({num_tokens, per_token}, values.options().dtype(accumulation_type(values)));
  const smf::DType dtype = kernel_dtype(values);
  SMF_RUN(values,
          smf::cpu::gather_backward_weights(dtype, grad_out.const_data_ptr(), values.const_data_ptr(),
                                            indices.const_data_ptr<int64_t>(), grad_weights.data_ptr(), num_tokens,
                                            per_token, dim, threads),
          smf::cuda::gather_backward_weights(dtype, grad_out.const_data_ptr(), values.const_data_ptr(),
                                             indices.const_data_ptr<int64_t>(), grad_weights.data_ptr(), num_tokens,
                                             per_token, dim, stream));
  return grad_weights;
}

at::Tensor gather_backward_values(const at::Tensor& grad_out_in, const at::Tensor& indices_in,
                                  const at::Tensor& weights_in, int64_t num_rows,
                                  std::optional<at::Tensor> update_rows_in) {
  TORCH_CHECK(num_rows >= 0, "smf_kernels ext: num_rows must be >= 0, got ", text(num_rows));
  check_reads(indices_in, weights_in, num_rows);
  check_rank(grad_out_in, "grad_out", 2, "(N, D)");
  check_grad_out(grad_out_in, indices_in, grad_out_in.size(1));
  if (update_rows_in.has_value()) {
    const at::Tensor& rows = *update_rows_in;
    check_update_rows(rows, num_rows, indices_in, "indices");
    // No row selected: an empty gradient (the kernels take a null update_rows for "dense").
    if (rows.numel() == 0)
      return at::zeros({0, grad_out_in.size(1)}, grad_out_in.options().dtype(accumulation_type(grad_out_in)));
  }
  const at::Tensor grad_out = kernel_input(grad_out_in), indices = indices_in.contiguous();
  const at::Tensor weights = weights_in.to(accumulation_type(grad_out)).contiguous();
  const at::Tensor update_rows = update_rows_in.has_value() ? update_rows_in->contiguous() : at::Tensor();
  const int64_t* update_rows_ptr = update_rows.defined() ? update_rows.const_data_ptr<int64_t>() : nullptr;
  const int64_t num_update_rows = update_rows.defined() ? update_rows.numel() : 0;
  const int64_t out_rows = update_rows.defined() ? num_update_rows : num_rows;
  const int64_t num_tokens = indices.size(0), per_token = indices.size(1), dim = grad_out.size(1);
  at::Tensor grad = smf::cpu::pooled_empty({out_rows, dim}, grad_out.options().dtype(accumulation_type(grad_out)));
  const smf::DType dtype = kernel_dtype(grad_out);
#ifdef SMF_WITH_CUDA
  at::Tensor workspace;
  if (grad_out.is_cuda()) {
    TORCH_CHECK(num_tokens * per_token < (int64_t(1) << 31) && num_rows < (int64_t(1) << 31),
                "smf_kernels ext: the CUDA backward indexes reads (N * L = ", text(num_tokens * per_token),
                ") and rows (M = ", text(num_rows), ") with int32; both must be < 2**31");
    const size_t bytes = smf::cuda::gather_backward_values_workspace_bytes(num_rows, out_rows, num_tokens * per_token);
    workspace = at::empty({static_cast<int64_t>(bytes)}, grad_out.options().dtype(at::kByte));
  }
#endif
  SMF_RUN(grad_out,
          smf::cpu::gather_backward_values(dtype, grad_out.const_data_ptr(), indices.const_data_ptr<int64_t>(),
                                           weights.const_data_ptr(), update_rows_ptr, num_update_rows,
                                           grad.data_ptr(), num_rows, num_tokens, per_token, dim, threads),
          smf::cuda::gather_backward_values(dtype, grad_out.const_data_ptr(), indices.const_data_ptr<int64_t>(),
                                            weights.const_data_ptr(), update_rows_ptr, num_update_rows,
                                            grad.data_ptr(), num_rows, num_tokens, per_token, dim,
                                            workspace.data_ptr(), workspace.numel(), stream));
  return grad;
}

// Both gradients of the gather in one pass (CPU): (grad_values (M or T, D), grad_weights (N, L)),
// acc dtype; a gradient not needed comes back with 0 rows.
std::tuple<at::Tensor, at::Tensor> gather_backward(const at::Tensor& grad_out_in, const at::Tensor& values_in,
                                                   const at::Tensor& indices_in, const at::Tensor& weights_in,
                                                   std::optional<at::Tensor> update_rows_in, bool need_values,
                                                   bool need_weights) {
  TORCH_CHECK(values_in.is_cpu() && grad_out_in.is_cpu(), "smf_kernels ext: the fused gather_backward runs on CPU; got ",
              values_in.device());
  check_rank(values_in, "values", 2, "(M, D)");
  check_float(values_in, "values");
  check_device(indices_in, "indices", values_in, "values");
  check_reads(indices_in, weights_in, values_in.size(0));
  check_grad_out(grad_out_in, indices_in, values_in.size(1));
  if (update_rows_in.has_value()) check_update_rows(*update_rows_in, values_in.size(0), values_in, "values");
  at::Tensor values = kernel_input(values_in), grad_out = kernel_input(grad_out_in);
  if (grad_out.scalar_type() != values.scalar_type()) {  // mixed dtypes: both in values' accumulation dtype
    const at::ScalarType common = accumulation_type(values);
    values = values.to(common);
    grad_out = grad_out.to(common);
  }
  const at::ScalarType acc = accumulation_type(values);
  const at::Tensor indices = indices_in.contiguous(), weights = weights_in.to(acc).contiguous();
  const at::Tensor update_rows = update_rows_in.has_value() ? update_rows_in->contiguous() : at::Tensor();
  const int64_t num_tokens = indices.size(0), per_token = indices.size(1), dim = values.size(1);
  const int64_t out_rows = update_rows.defined() ? update_rows.numel() : values.size(0);
  at::Tensor grad_values = smf::cpu::pooled_empty({need_values ? out_rows : 0, dim}, values.options().dtype(acc));
  at::Tensor grad_weights = at::empty({need_weights ? num_tokens : 0, per_token}, values.options().dtype(acc));
  if (!need_values && !need_weights) return {grad_values, grad_weights};
  smf::cpu::gather_backward(kernel_dtype(values), grad_out.const_data_ptr(), values.const_data_ptr(),
                            indices.const_data_ptr<int64_t>(), weights.const_data_ptr(),
                            update_rows.defined() ? update_rows.const_data_ptr<int64_t>() : nullptr,
                            update_rows.defined() ? update_rows.numel() : 0,
                            need_values ? grad_values.data_ptr() : nullptr,
                            need_weights ? grad_weights.data_ptr() : nullptr, values.size(0), num_tokens, per_token,
                            dim, at::get_num_threads());
  return {grad_values, grad_weights};
}

// Backward of the top-k (CPU): (grad_query (N, H, key_dim), grad_keys (H, 2, n_keys, key_dim / 2)),
// acc dtype; a gradient not needed comes back with 0 elements.
std::tuple<at::Tensor, at::Tensor> topk_backward(const at::Tensor& grad_scores_in, const at::Tensor& query_in,
                                                 const at::Tensor& keys_in, const at::Tensor& indices_in,
                                                 bool need_query, bool need_keys) {
  TORCH_CHECK(query_in.is_cpu(), "smf_kernels ext: the fused topk_backward runs on CPU; got ", query_in.device());
  check_rank(query_in, "query", 3, "(N, H, key_dim)");
  check_float(query_in, "query");
  check_rank(keys_in, "keys", 4, "(H, 2, n_keys, key_dim / 2)");
  check_float(keys_in, "keys");
  TORCH_CHECK(query_in.size(2) % 2 == 0 && keys_in.size(0) == query_in.size(1) && keys_in.size(1) == 2 &&
                  keys_in.size(3) == query_in.size(2) / 2,
              "smf_kernels ext: keys must have shape (H, 2, n_keys, key_dim / 2) for query ", text(query_in.sizes()),
              ", got ", text(keys_in.sizes()));
  check_rank(indices_in, "indices", 3, "(N, H, topk)");
  check_dtype(indices_in, "indices", at::kLong);
  TORCH_CHECK(indices_in.size(0) == query_in.size(0) && indices_in.size(1) == query_in.size(1),
              "smf_kernels ext: indices must have shape (N, H, topk) for query ", text(query_in.sizes()), ", got ",
              text(indices_in.sizes()));
  check_rank(grad_scores_in, "grad_scores", 3, "(N, H, topk)");
  check_float(grad_scores_in, "grad_scores");
  TORCH_CHECK(grad_scores_in.sizes() == indices_in.sizes(), "smf_kernels ext: grad_scores must have the shape of "
              "indices ", text(indices_in.sizes()), ", got ", text(grad_scores_in.sizes()));
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{keys_in, "keys"},
                                std::pair<const at::Tensor&, const char*>{indices_in, "indices"},
                                std::pair<const at::Tensor&, const char*>{grad_scores_in, "grad_scores"}})
    check_device(t, name, query_in, "query");
  check_index_range(indices_in, "indices", keys_in.size(2) * keys_in.size(2));
  const at::Tensor query = kernel_input(query_in), keys = kernel_input(keys_in).to(query.scalar_type());
  const at::ScalarType acc = accumulation_type(query);
  const at::Tensor grad_scores = grad_scores_in.to(acc).contiguous(), indices = indices_in.contiguous();
  const int64_t num_tokens = query.size(0), heads = query.size(1), key_dim = query.size(2);
  const int64_t n_keys = keys.size(2), topk = indices.size(2);
  at::Tensor grad_query = need_query ? smf::cpu::pooled_empty(query.sizes(), query.options().dtype(acc))
                                     : at::empty({0}, query.options().dtype(acc));
  at::Tensor grad_keys = need_keys ? at::empty(keys.sizes(), keys.options().dtype(acc))
                                   : at::empty({0}, keys.options().dtype(acc));
  if (!need_query && !need_keys) return {grad_query, grad_keys};
  smf::cpu::topk_backward(kernel_dtype(query), grad_scores.const_data_ptr(), query.const_data_ptr(),
                          keys.const_data_ptr(), indices.const_data_ptr<int64_t>(),
                          need_query ? grad_query.data_ptr() : nullptr, need_keys ? grad_keys.data_ptr() : nullptr,
                          num_tokens, heads, key_dim / 2, n_keys, topk, at::get_num_threads());
  return {grad_query, grad_keys};
}

// silu(gate) * read and its backward (CPU): gate and read of one shape, float dtype and device.
void check_silu_mul(const at::Tensor& gate, const at::Tensor& read) {
  TORCH_CHECK(gate.is_cpu(), "smf_kernels ext: silu_mul runs on CPU; got ", gate.device());
  check_float(gate, "gate");
  check_dtype(read, "read", gate.scalar_type());
  check_device(read, "read", gate, "gate");
  TORCH_CHECK(read.sizes() == gate.sizes(), "smf_kernels ext: read must have the shape of gate ",
              text(gate.sizes()), ", got ", text(read.sizes()));
}

at::Tensor silu_mul_forward(const at::Tensor& gate_in, const at::Tensor& read_in) {
  check_silu_mul(gate_in, read_in);
  const at::Tensor gate = kernel_input(gate_in), read = kernel_input(read_in);
  at::Tensor out = smf::cpu::pooled_empty(gate.sizes(), gate.options());
  smf::cpu::silu_mul_forward(kernel_dtype(gate), gate.const_data_ptr(), read.const_data_ptr(), out.data_ptr(),
                             gate.numel(), at::get_num_threads());
  return out.to(gate_in.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                     const at::Tensor& read_in) {
  check_silu_mul(gate_in, read_in);
  check_dtype(grad_in, "grad", gate_in.scalar_type());
  check_device(grad_in, "grad", gate_in, "gate");
  TORCH_CHECK(grad_in.sizes() == gate_in.sizes(), "smf_kernels ext: grad must have the shape of gate ",
              text(gate_in.sizes()), ", got ", text(grad_in.sizes()));
  const at::Tensor grad = kernel_input(grad_in), gate = kernel_input(gate_in), read = kernel_input(read_in);
  at::Tensor grad_gate = smf::cpu::pooled_empty(gate.sizes(), gate.options());
  at::Tensor grad_read = smf::cpu::pooled_empty(gate.sizes(), gate.options());
  smf::cpu::silu_mul_backward(kernel_dtype(gate), grad.const_data_ptr(), gate.const_data_ptr(), read.const_data_ptr(),
                              grad_gate.data_ptr(), grad_read.data_ptr(), gate.numel(), at::get_num_threads());
  return {grad_gate.to(gate_in.scalar_type()), grad_read.to(gate_in.scalar_type())};
}

// AdamW on rows of a table in place (CPU): param (M, D) of one float dtype (not float16), rows (T,) int64 strictly
// ascending in [0, M), grad (T, D) acc, valid (T,) bool or None, grad_scale a number; the state exp_avg,
// exp_avg_sq (M, D) of param's dtype and row_step (M,) int64 by row, or with state_slots (T,) int64 distinct in
// [0, S) (S, D) and (S,) by slot. Everything is checked before any row is touched.
void row_adamw(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor row_step,
               const at::Tensor& rows, const at::Tensor& grad_in, std::optional<at::Tensor> valid_in, double lr,
               double grad_scale, double beta1, double beta2, double eps, double weight_decay,
               std::optional<at::Tensor> state_slots_in) {
  TORCH_CHECK(param.is_cpu(), "smf_kernels ext: row_adamw runs on CPU; got ", param.device());
  check_rank(param, "param", 2, "(M, D)");
  check_float(param, "param");
  TORCH_CHECK(param.scalar_type() != at::kHalf, "smf_kernels ext: row_adamw takes no float16 table");
  check_rank(row_step, "row_step", 1, state_slots_in.has_value() ? "(S,)" : "(M,)");
  check_dtype(row_step, "row_step", at::kLong);
  check_device(row_step, "row_step", param, "param");
  const int64_t state_rows = state_slots_in.has_value() ? row_step.size(0) : param.size(0);
  TORCH_CHECK(row_step.size(0) == state_rows, "smf_kernels ext: row_step must have shape (M,) = (",
              text(param.size(0)), "), got ", text(row_step.sizes()));
  for (const auto& [state, name] : {std::pair<const at::Tensor&, const char*>{exp_avg, "exp_avg"},
                                    std::pair<const at::Tensor&, const char*>{exp_avg_sq, "exp_avg_sq"}}) {
    check_dtype(state, name, param.scalar_type());
    check_device(state, name, param, "param");
    TORCH_CHECK(state.dim() == 2 && state.size(0) == state_rows && state.size(1) == param.size(1),
                "smf_kernels ext: ", name, " must have shape (", text(state_rows), ", ", text(param.size(1)),
                "), got ", text(state.sizes()));
  }
  TORCH_CHECK(param.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() &&
                  row_step.is_contiguous(),
              "smf_kernels ext: row_adamw updates param and its state in place: they must be contiguous");
  check_rank(rows, "rows", 1, "(T,)");
  check_dtype(rows, "rows", at::kLong);
  check_device(rows, "rows", param, "param");
  check_index_range(rows, "rows", param.size(0));
  const at::Tensor ordered = rows.contiguous();
  const int64_t* row_ids = ordered.const_data_ptr<int64_t>();
  for (int64_t t = 1; t < ordered.numel(); ++t)
    TORCH_CHECK(row_ids[t] > row_ids[t - 1], "smf_kernels ext: rows must be strictly ascending (sorted, distinct)");
  at::Tensor state_slots;
  if (state_slots_in.has_value()) {
    state_slots = state_slots_in->contiguous();
    check_rank(state_slots, "state_slots", 1, "(T,)");
    check_dtype(state_slots, "state_slots", at::kLong);
    check_device(state_slots, "state_slots", param, "param");
    TORCH_CHECK(state_slots.numel() == rows.numel(), "smf_kernels ext: state_slots must have shape (T,) = (",
                text(rows.numel()), "), got ", text(state_slots.sizes()));
    check_index_range(state_slots, "state_slots", state_rows);
    const at::Tensor sorted = std::get<0>(state_slots.sort());  // threads own slots: they must be distinct
    const int64_t* slot_ids = sorted.const_data_ptr<int64_t>();
    for (int64_t t = 1; t < sorted.numel(); ++t)
      TORCH_CHECK(slot_ids[t] != slot_ids[t - 1], "smf_kernels ext: state_slots must be distinct");
  }
  check_rank(grad_in, "grad", 2, "(T, D)");
  check_dtype(grad_in, "grad", accumulation_type(param));
  check_device(grad_in, "grad", param, "param");
  TORCH_CHECK(grad_in.size(0) == rows.numel() && grad_in.size(1) == param.size(1),
              "smf_kernels ext: grad must have shape (T, D) = (", text(rows.numel()), ", ", text(param.size(1)),
              "), got ", text(grad_in.sizes()));
  at::Tensor valid;
  if (valid_in.has_value()) {
    valid = valid_in->contiguous();
    check_rank(valid, "valid", 1, "(T,)");
    check_dtype(valid, "valid", at::kBool);
    check_device(valid, "valid", param, "param");
    TORCH_CHECK(valid.numel() == rows.numel(), "smf_kernels ext: valid must have shape (T,) = (",
                text(rows.numel()), "), got ", text(valid.sizes()));
  }
  const at::Tensor grad = grad_in.contiguous();
  smf::cpu::row_adamw(kernel_dtype(param), param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                      row_step.data_ptr<int64_t>(), row_ids,
                      state_slots.defined() ? state_slots.const_data_ptr<int64_t>() : nullptr, grad.const_data_ptr(),
                      valid.defined() ? valid.const_data_ptr<bool>() : nullptr, rows.numel(), param.size(1), lr,
                      grad_scale, beta1, beta2, eps, weight_decay, at::get_num_threads());
}

#define SMF_STRINGIFY(x) #x
#define SMF_EXPAND_STRINGIFY(x) SMF_STRINGIFY(x)

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "smf_kernels compiled kernels (csrc/); use them through smf_kernels.ops with backend='ext'";
  m.attr("source_hash") = SMF_EXPAND_STRINGIFY(SMF_EXT_SOURCE_HASH);  // checked by build_ext.load_extension
#ifdef SMF_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("topk_forward", &topk_forward, "scores (N, H, k) acc, indices (N, H, k) int64",
        py::arg("query"), py::arg("keys"), py::arg("topk"), py::arg("key_layout") = py::none());
  m.def("prepare_topk_keys", &prepare_topk_keys, "the keys as topk_forward reads them (its key_layout)",
        py::arg("keys"));
  m.def("gather_forward", &gather_forward, "out (N, D); counts updated in place", py::arg("values"),
        py::arg("indices"), py::arg("weights"), py::arg("counts"), py::arg("valid"));
  m.def("gather_backward_weights", &gather_backward_weights, "grad of weights (N, L) acc", py::arg("grad_out"),
        py::arg("values"), py::arg("indices"));
  m.def("topk_backward", &topk_backward, "(grad of query (N, H, key_dim), grad of keys), acc; CPU",
        py::arg("grad_scores"), py::arg("query"), py::arg("keys"), py::arg("indices"), py::arg("need_query"),
        py::arg("need_keys"));
  m.def("gather_backward", &gather_backward, "(grad of values (M or T, D), grad of weights (N, L)), acc; CPU",
        py::arg("grad_out"), py::arg("values"), py::arg("indices"), py::arg("weights"), py::arg("update_rows"),
        py::arg("need_values"), py::arg("need_weights"));
  m.def("gather_backward_values", &gather_backward_values, "grad of values (M or T, D) acc", py::arg("grad_out"),
        py::arg("indices"), py::arg("weights"), py::arg("num_rows"), py::arg("update_rows"));
  m.def("silu_mul_forward", &silu_mul_forward, "silu(gate) * read, gate's dtype; CPU", py::arg("gate"),
        py::arg("read"));
  m.def("silu_mul_backward", &silu_mul_backward, "(grad of gate, grad of read), gate's dtype; CPU", py::arg("grad"),
        py::arg("gate"), py::arg("read"));
  m.def("row_adamw", &row_adamw, "AdamW on rows of a table, in place; CPU", py::arg("param"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("row_step"), py::arg("rows"), py::arg("grad"), py::arg("valid"), py::arg("lr"),
        py::arg("grad_scale"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("state_slots") = py::none());
  m.def("release_idle_outputs", &smf::cpu::release_idle_outputs,
        "return the cached blocks of freed large CPU outputs to the system; the bytes released");
}
