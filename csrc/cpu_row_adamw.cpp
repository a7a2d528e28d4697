// CPU kernel of row-sparse AdamW (see cpu_kernels.h).
#include "cpu_common.h"

namespace smf::cpu {

// AdamW on rows of a table, one pass over each selected row: its parameter and both moments are read
// and written once (smf_kernels/ops/row_adamw.py has the formulas). Rows are distinct, so threads own rows.
// The moments and the step count of row rows[t] are at row slots[t] of the state when slots is given (distinct
// too), else at row rows[t].
// The moments and the parameter are rounded to T where torch's optimizer rounds them; the bias
// corrections are computed in double and rounded to A, as RowSparseAdamW's factors are.
template <typename T>
void row_adamw_impl(T* param, T* exp_avg, T* exp_avg_sq, int64_t* row_step, const int64_t* rows,
                    const int64_t* slots, const typename Accumulate<T>::type* grad, const bool* valid, int64_t num_update_rows, int64_t dim,
                    double lr, double grad_scale, double beta1, double beta2, double eps, double weight_decay,
                    int threads) {
  using A = typename Accumulate<T>::type;
  const A scale = static_cast<A>(grad_scale), one_minus_beta1 = static_cast<A>(1.0 - beta1);
  const A beta2_a = static_cast<A>(beta2), one_minus_beta2 = static_cast<A>(1.0 - beta2);
  const A decay = static_cast<A>(1.0 - lr * weight_decay), eps_a = static_cast<A>(eps);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_update_rows; ++t) {
    if (valid != nullptr && !valid[t]) continue;
    const int64_t r = rows[t], s = slots != nullptr ? slots[t] : r;
    const int64_t step = ++row_step[s];
    const A step_size = static_cast<A>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
    const A correction2 = static_cast<A>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
    T* p = param + r * dim;
    T* m = exp_avg + s * dim;
    T* v = exp_avg_sq + s * dim;
    const A* g_row = grad + t * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const A g = rounded<T>(g_row[d] * scale);  // the gradient in the table's dtype, as torch's is
      const A m_old = load(m[d]);
      store(m_old + one_minus_beta1 * (g - m_old), m + d);
      store(rounded<T>(load(v[d]) * beta2_a) + one_minus_beta2 * g * g, v + d);
      const A denom = std::sqrt(load(v[d])) / correction2 + eps_a;
      const A decayed = weight_decay != 0.0 ? rounded<T>(load(p[d]) * decay) : load(p[d]);
      store(decayed - load(m[d]) / denom * step_size, p + d);
    }
  }
}

void row_adamw(DType dtype, void* param, void* exp_avg, void* exp_avg_sq, int64_t* row_step, const int64_t* rows,
               const int64_t* slots, const void* grad, const bool* valid, int64_t num_update_rows, int64_t dim, double lr, double grad_scale,
               double beta1, double beta2, double eps, double weight_decay, int threads) {
  SMF_CPU_DISPATCH(dtype, row_adamw_impl(static_cast<T*>(param), static_cast<T*>(exp_avg), static_cast<T*>(exp_avg_sq),
                                         row_step, rows, slots, static_cast<const typename Accumulate<T>::type*>(grad), valid,
                                         num_update_rows, dim, lr, grad_scale, beta1, beta2, eps, weight_decay,
                                         threads));
}

}  // namespace smf::cpu
