// The kernels' tensor-level entry points (norm_ops.cpp), as norm_bind.cpp binds them to Python. Light headers only:
// the Tensor type, not the operator library or the autograd machinery.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace normatlas {

// The custom op's forward: (y, h, stats) for x of any shape whose trailing features hold n elements; h = x + residual
// (empty without one); stats (rows, 3) in the accumulation dtype: mean, rstd, d rstd / d ms.
std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                 double eps, bool center, int64_t eps_mode, bool before_gain, bool one_plus_w, bool l2,
                                 int64_t n);

// The custom op's backward: (dx, dgain, dbias), the gradients in the accumulation dtype (empty when not needed).
std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& stats, const std::optional<at::Tensor>& dres, bool center,
                                 bool before_gain, bool one_plus_w, bool l2, bool need_dg, bool need_db, int64_t n);

// The eager entry point: (y, h), with the backward in C++ when any input requires grad.
std::vector<at::Tensor> norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double eps, bool center, int64_t eps_mode, bool before_gain, bool one_plus_w, bool l2,
                             int64_t n);

// One (spec, input dtype)'s eager hot path (api.py's plans): the flags bound once, and the checks that send a call to
// the checked Python path instead (a tensor off the CPU, trailing dims other than normalized_shape, a weight or bias
// of another shape, a weight the spec does not use or lacks for 1 + w, parameters in another dtype under the cast
// before the gain, a residual shaped or typed unlike x, no features) made here: in Python they cost about 1 us a call,
// as much as the kernel on a small input. A call returns norm()'s (y, h), or nothing where a check fails.
struct Plan {
  Plan(int64_t k, bool use_weight, bool needs_weight, bool strict, double eps, bool center, int64_t eps_mode,
       bool before_gain, bool one_plus_w, bool l2);
  std::optional<std::vector<at::Tensor>> operator()(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                    const std::optional<at::Tensor>& weight,
                                                    const std::optional<at::Tensor>& bias,
                                                    const std::optional<std::vector<int64_t>>& fshape) const;
  // norm_pair with these flags (QK-norm's one launch; the caller has checked its preconditions).
  std::vector<at::Tensor> pair(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& wq,
                               const std::optional<at::Tensor>& wk, int64_t n) const;
  int64_t k;          // the number of trailing feature dims
  bool use_weight;    // the spec has a per-feature gain
  bool needs_weight;  // its convention (1 + w) cannot run without the weight
  bool strict;        // cast before the gain: weight and bias must be in x's dtype
  double eps;
  bool center;
  int64_t eps_mode;
  bool before_gain, one_plus_w, l2;
};

// Two forwards in one parallel region (QK-norm for inference, no autograd): (yq, yk).
std::vector<at::Tensor> norm_pair(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& wq,
                                  const std::optional<at::Tensor>& wk, double eps, bool center, int64_t eps_mode,
                                  bool before_gain, bool one_plus_w, bool l2, int64_t n);

// The output pass alone, y = x * s * weight (the benchmarks' floor under any norm forward).
at::Tensor affine_floor(const at::Tensor& x, const at::Tensor& weight, double s);

}  // namespace normatlas
