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

// Two forwards in one parallel region (QK-norm for inference, no autograd): (yq, yk).
std::vector<at::Tensor> norm_pair(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& wq,
                                  const std::optional<at::Tensor>& wk, double eps, bool center, int64_t eps_mode,
                                  bool before_gain, bool one_plus_w, bool l2, int64_t n);

// The output pass alone, y = x * s * weight (the benchmarks' floor under any norm forward).
at::Tensor affine_floor(const at::Tensor& x, const at::Tensor& weight, double s);

}  // namespace normatlas
