// Tensors in, row kernels called, tensors out (norm_ops.h), with the eager autograd in C++ so a training step pays
// one call for the norm. norm_bind.cpp binds these functions to Python.
//
// Only the headers this file needs (ATen and the C++ autograd Function), not torch/extension.h: that header pulls in
// the whole C++ frontend and was most of a one-file build's time.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "norm_kernels.h"
#include "norm_ops.h"

namespace {

using normatlas::Dtype;

// The kernels' storage dtype of the tensor called `what`; a TypeError (Python) naming it for any other dtype.
Dtype dtype_of(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return Dtype::F32;
    case at::kDouble: return Dtype::F64;
    case at::kBFloat16: return Dtype::BF16;
    case at::kHalf: return Dtype::F16;
    default:
      TORCH_CHECK_TYPE(false, what, " has dtype ", t, "; the normatlas CPU kernels take float32, float64, bfloat16 ",
                       "or float16");
  }
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// A weight or bias as the kernels take it (norm_kernels.h's Param: its data in its own dtype, each worker converts
// it), with the contiguous tensor that data points into kept alive for the call. Absent: a Param without data.
struct Held {
  at::Tensor t;
  normatlas::Param p;
};

Held param_of(const at::Tensor& t, const char* what, int64_t n, bool plus_one = false, bool round = false) {
  if (!t.defined()) return {t, {nullptr, Dtype::F32, false, false}};
  TORCH_CHECK(t.numel() == n, what, " must have ", n, " elements, got ", t.numel());
  const Dtype dt = dtype_of(t.scalar_type(), what);
  at::Tensor c = t.contiguous();
  return {c, {c.data_ptr(), dt, plus_one, round}};
}

// One normalization's flags as the op passes them: the row flags, the gain convention and the feature size.
struct Flags {
  normatlas::RowFlags row;
  bool one_plus_w;
  int64_t n;
};

int64_t rows_of(const at::Tensor& x, int64_t n) {
  TORCH_CHECK(n > 0 && x.numel() % n == 0, "the feature size ", n, " does not divide numel ", x.numel());
  return x.numel() / n;
}

const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// A new output shaped and typed like `like`, its pages advised before the kernel's first write.
at::Tensor new_output(const at::Tensor& like) {
  at::Tensor t = at::empty(like.sizes(), like.options());
  normatlas::advise_output(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
  return t;
}

// y and h shaped like x (h empty without a residual) and stats (rows, 3): mean, rstd, d rstd / d ms.
std::vector<at::Tensor> fwd_core(const at::Tensor& x_in, const at::Tensor& res_in, const at::Tensor& weight,
                                 const at::Tensor& bias, const Flags& f) {
  const at::Tensor x = x_in.contiguous();
  const int64_t n = f.n, rows = rows_of(x, n);
  const Dtype dt = dtype_of(x.scalar_type(), "input");
  at::Tensor res;
  if (res_in.defined()) {
    TORCH_CHECK(res_in.sizes() == x.sizes() && res_in.scalar_type() == x.scalar_type(),
                "residual must be shaped and typed like x");
    res = res_in.contiguous();
  }
  const auto acc = acc_type(x.scalar_type());
  auto y = new_output(x);
  auto h = res.defined() ? new_output(x) : at::empty({0}, x.options());
  auto stats = at::empty({rows, 3}, x.options().dtype(acc));
  if (rows == 0) return {y, h, stats};
  const Held g = param_of(weight, "weight", n, f.one_plus_w, f.row.before_gain), b = param_of(bias, "bias", n);
  normatlas::forward(dt, x.data_ptr(), ptr_or_null(res), res.defined() ? h.data_ptr() : nullptr, y.data_ptr(), g.p, b.p,
                     stats.data_ptr(), rows, n, f.row, true);
  return {y, h, stats};
}

// dx shaped like x (plus d_residual_out when given) and dgain / dbias of shape (n,) in the accumulation dtype
// (empty when not needed).
std::vector<at::Tensor> bwd_core(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& weight,
                                 const at::Tensor& stats_in, const at::Tensor& dres_in, const Flags& f, bool need_dg,
                                 bool need_db) {
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous(), stats = stats_in.contiguous();
  const int64_t n = f.n, rows = rows_of(x, n);
  const Dtype dt = dtype_of(x.scalar_type(), "input");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "dy must be shaped and typed like x");
  at::Tensor dres;
  if (dres_in.defined()) {
    TORCH_CHECK(dres_in.numel() == x.numel(), "d_residual must be shaped like x");
    dres = dres_in.to(x.scalar_type()).contiguous();
  }
  const auto acc = acc_type(x.scalar_type());
  TORCH_CHECK(stats.scalar_type() == acc && stats.numel() == 3 * rows, "stats must be (rows, 3) in ", acc);
  auto dx = new_output(x);
  auto opts = x.options().dtype(acc);
  auto dg = need_dg ? at::zeros({n}, opts) : at::empty({0}, opts);
  auto db = need_db ? at::zeros({n}, opts) : at::empty({0}, opts);
  if (rows == 0) return {dx, dg, db};
  const Held g = param_of(weight, "weight", n, f.one_plus_w, f.row.before_gain);
  normatlas::backward(dt, dy.data_ptr(), x.data_ptr(), ptr_or_null(dres), dx.data_ptr(), g.p, stats.data_ptr(),
                      need_dg ? dg.data_ptr() : nullptr, need_db ? db.data_ptr() : nullptr, rows, n, f.row);
  return {dx, dg, db};
}

at::Tensor opt(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

Flags flags(double eps, bool center, int64_t eps_mode, bool before_gain, bool one_plus_w, bool l2, int64_t n) {
  return Flags{normatlas::RowFlags{eps, center, eps_mode, before_gain, l2}, one_plus_w, n};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Eager autograd without a Python frame: forward and backward both run here, so a training step pays
// one pybind11 call for the norm instead of the Python autograd.Function machinery.
struct NormFn : public torch::autograd::Function<NormFn> {
  // absent tensors are passed as empty optionals, so they take no autograd edge
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& res_o,
                               const std::optional<at::Tensor>& weight_o, const std::optional<at::Tensor>& bias_o,
                               double eps, bool center, int64_t eps_mode, bool before_gain, bool one_plus_w, bool l2,
                               int64_t n) {
    const at::Tensor res = opt(res_o), weight = opt(weight_o), bias = opt(bias_o);
    auto out = fwd_core(x, res, weight, bias, flags(eps, center, eps_mode, before_gain, one_plus_w, l2, n));
    ctx->save_for_backward({res.defined() ? out[1] : x, weight, out[2]});
    ctx->saved_data["center"] = center;
    ctx->saved_data["before_gain"] = before_gain;
    ctx->saved_data["one_plus_w"] = one_plus_w;
    ctx->saved_data["l2"] = l2;
    ctx->saved_data["n"] = n;
    ctx->saved_data["has_res"] = res.defined();
    ctx->saved_data["has_bias"] = bias.defined();
    if (bias.defined()) {
      ctx->saved_data["bias_dtype"] = bias.scalar_type();
      ctx->saved_data["bias_shape"] = bias.sizes().vec();
    }
    ctx->set_materialize_grads(false);
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::autograd::GradMode::is_enabled(),
                "normatlas fused norm: double backward (create_graph=True) is not supported on the eager path");
    auto saved = ctx->get_saved_variables();
    const at::Tensor& src = saved[0];
    const at::Tensor& weight = saved[1];
    const bool has_res = ctx->saved_data["has_res"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const Flags f = flags(0.0, ctx->saved_data["center"].toBool(), 0, ctx->saved_data["before_gain"].toBool(),
                          ctx->saved_data["one_plus_w"].toBool(), ctx->saved_data["l2"].toBool(),
                          ctx->saved_data["n"].toInt());
    at::Tensor dy = grads[0];
    at::Tensor dh = has_res ? grads[1] : at::Tensor();
    variable_list out(11);
    if (!dy.defined() && !dh.defined()) return out;
    if (!dy.defined()) dy = at::zeros_like(src);
    // edge indices count only the tensors that were passed: x, then residual, weight, bias if present
    const size_t e_w = has_res ? 2 : 1, e_b = e_w + (weight.defined() ? 1 : 0);
    const bool need_dg = weight.defined() && ctx->needs_input_grad(e_w);
    const bool need_db = has_bias && ctx->needs_input_grad(e_b);
    auto g = bwd_core(dy, src, weight, saved[2], dh, f, need_dg, need_db);
    if (ctx->needs_input_grad(0)) out[0] = g[0];
    if (has_res && ctx->needs_input_grad(1)) out[1] = g[0];
    if (need_dg) out[2] = g[1].to(weight.scalar_type()).view(weight.sizes());
    if (need_db) {
      const auto bt = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toScalarType());
      out[3] = g[2].to(bt).view(ctx->saved_data["bias_shape"].toIntVector());
    }
    return out;
  }
};

}  // namespace

namespace normatlas {

// The custom op's implementations (used under torch.compile and by the eager fallback's tests): x of any
// shape whose trailing features hold n elements; weight / bias as given (any float dtype, numel n).
std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                 double eps, bool center, int64_t eps_mode, bool before_gain, bool one_plus_w, bool l2,
                                 int64_t n) {
  return fwd_core(x, opt(residual), opt(weight), opt(bias),
                  flags(eps, center, eps_mode, before_gain, one_plus_w, l2, n));
}

std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& stats, const std::optional<at::Tensor>& dres, bool center,
                                 bool before_gain, bool one_plus_w, bool l2, bool need_dg, bool need_db, int64_t n) {
  return bwd_core(dy, x, opt(weight), stats, opt(dres), flags(0.0, center, 0, before_gain, one_plus_w, l2, n), need_dg,
                  need_db);
}

// The eager entry point: (y, h) with autograd handled in C++ when any input requires grad.
std::vector<at::Tensor> norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double eps, bool center, int64_t eps_mode, bool before_gain, bool one_plus_w, bool l2,
                             int64_t n) {
  const at::Tensor r = opt(residual), w = opt(weight), b = opt(bias);
  const bool grad = torch::autograd::GradMode::is_enabled() &&
                    (x.requires_grad() || (r.defined() && r.requires_grad()) || (w.defined() && w.requires_grad()) ||
                     (b.defined() && b.requires_grad()));
  if (!grad) {
    auto out = fwd_core(x, r, w, b, flags(eps, center, eps_mode, before_gain, one_plus_w, l2, n));
    return {out[0], out[1]};
  }
  return NormFn::apply(x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2, n);
}

Plan::Plan(int64_t k, bool use_weight, bool needs_weight, bool strict, double eps, bool center, int64_t eps_mode,
           bool before_gain, bool one_plus_w, bool l2)
    : k(k), use_weight(use_weight), needs_weight(needs_weight), strict(strict), eps(eps), center(center),
      eps_mode(eps_mode), before_gain(before_gain), one_plus_w(one_plus_w), l2(l2) {}

std::optional<std::vector<at::Tensor>> Plan::operator()(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                        const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias,
                                                        const std::optional<std::vector<int64_t>>& fshape) const {
  if (!x.is_cpu() || x.dim() < k) return std::nullopt;
  const at::IntArrayRef feat = x.sizes().slice(static_cast<size_t>(x.dim() - k));
  if (fshape && feat != at::IntArrayRef(*fshape)) return std::nullopt;
  const auto serves = [&](const at::Tensor& p) {
    return p.is_cpu() && p.sizes() == feat && (!strict || p.scalar_type() == x.scalar_type());
  };
  if (!weight ? needs_weight && use_weight : !use_weight || !serves(*weight)) return std::nullopt;
  if (bias && !serves(*bias)) return std::nullopt;
  if (residual && (!residual->is_cpu() || residual->sizes() != x.sizes() ||
                   residual->scalar_type() != x.scalar_type())) {
    return std::nullopt;
  }
  int64_t n = 1;
  for (const int64_t d : feat) n *= d;
  if (n == 0) return std::nullopt;
  return norm(x, residual, weight, bias, eps, center, eps_mode, before_gain, one_plus_w, l2, n);
}

std::vector<at::Tensor> Plan::pair(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& wq,
                                   const std::optional<at::Tensor>& wk, int64_t n) const {
  return norm_pair(q, k, wq, wk, eps, center, eps_mode, before_gain, one_plus_w, l2, n);
}

// The output pass alone, y = x * s * weight row by row (no statistics): the floor under any norm forward on this
// machine, timed by the benchmark suite next to a copy. Same threading, allocation and vector code as the forward.
at::Tensor affine_floor(const at::Tensor& x_in, const at::Tensor& weight, double s) {
  const at::Tensor x = x_in.contiguous();
  const int64_t n = weight.numel(), rows = rows_of(x, n);
  TORCH_CHECK(x.scalar_type() != at::kDouble, "affine_floor serves float32 / bfloat16 / float16");
  const Dtype dt = dtype_of(x.scalar_type(), "input");
  auto y = new_output(x);
  normatlas::affine_floor_rows(dt, x.data_ptr(), y.data_ptr(), param_of(weight, "weight", n).p, static_cast<float>(s),
                               rows, n);
  return y;
}

// QK-norm in one launch (inference): normalise the rows of q and of k (both with trailing size n) in one parallel
// region split over their rows together, instead of two launches with two thread-pool wake-ups. No autograd (the
// caller checks).
std::vector<at::Tensor> norm_pair(const at::Tensor& q_in, const at::Tensor& k_in, const std::optional<at::Tensor>& wq,
                                  const std::optional<at::Tensor>& wk, double eps, bool center, int64_t eps_mode,
                                  bool before_gain, bool one_plus_w, bool l2, int64_t n) {
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous();
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  const Dtype dt = dtype_of(q.scalar_type(), "q");
  const int64_t rq = rows_of(q, n), rk = rows_of(k, n);
  auto yq = at::empty(q.sizes(), q.options()), yk = at::empty(k.sizes(), k.options());
  if (rq + rk == 0) return {yq, yk};
  const auto acc = acc_type(q.scalar_type());
  auto stats = at::empty({rq + rk, 3}, q.options().dtype(acc));
  const normatlas::RowFlags f{eps, center, eps_mode, before_gain, l2};
  const Held gq = param_of(opt(wq), "q_weight", n, one_plus_w, before_gain);
  const Held gk = param_of(opt(wk), "k_weight", n, one_plus_w, before_gain);
  normatlas::forward_pair(dt, q.data_ptr(), k.data_ptr(), yq.data_ptr(), yk.data_ptr(), gq.p, gk.p, stats.data_ptr(),
                          rq, rk, n, f);
  return {yq, yk};
}

}  // namespace normatlas
