// Fused row-wise normalization (RMSNorm / LayerNorm / L2, optional residual add) for CPU.
//
// One kernel serves every channels-last spec the core can hand it: statistics in fp32 (fp64 for
// double inputs), eps inside or outside the sqrt or as a clamp, the gain applied after or before
// the cast back, an optional bias, and an optional residual add whose sum is written out too.
// Each row is read from memory once (it stays in L1/L2 for the later passes) and written once, so
// the forward runs at the speed of a copy. The backward reads x and dy once, writes dx once, and
// accumulates the gain / bias gradients in one partial sum per thread chunk.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T> struct IO;

template <> struct IO<float> {
  using raw = float;
  using acc = float;
  static inline float ld(float v) { return v; }
  static inline float st(float v) { return v; }
};

template <> struct IO<double> {
  using raw = double;
  using acc = double;
  static inline double ld(double v) { return v; }
  static inline double st(double v) { return v; }
};

template <> struct IO<c10::BFloat16> {
  using raw = uint16_t;
  using acc = float;
  static inline float ld(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t st(float f) {  // round to nearest even, NaN kept quiet
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : r);
  }
};

template <> struct IO<c10::Half> {
  using raw = c10::Half;
  using acc = float;
  static inline float ld(c10::Half v) { return static_cast<float>(v); }
  static inline c10::Half st(float v) { return c10::Half(v); }
};

enum EpsMode : int64_t { INSIDE = 0, OUTSIDE = 1, CLAMP = 2 };

// rstd r(ms) and dr/dms for the three eps placements.
template <typename A>
inline void scale_of(A ms, A eps, int64_t mode, A& r, A& drdms) {
  if (mode == INSIDE) {
    r = A(1) / std::sqrt(ms + eps);
    drdms = A(-0.5) * r * r * r;
  } else {
    A s = std::sqrt(ms);
    if (mode == OUTSIDE) {
      r = A(1) / (s + eps);
      drdms = s > A(0) ? A(-0.5) * r * r / s : A(0);
    } else {
      r = A(1) / (s > eps ? s : eps);
      drdms = s >= eps && s > A(0) ? A(-0.5) / (s * s * s) : A(0);
    }
  }
}

template <typename T>
void fwd_impl(const at::Tensor& x, const c10::optional<at::Tensor>& res, const at::Tensor& gain,
              const c10::optional<at::Tensor>& bias, at::Tensor& y, at::Tensor& h, at::Tensor& stats,
              double eps_d, bool center, int64_t eps_mode, bool before_gain, bool l2) {
  using R = typename IO<T>::raw;
  using A = typename IO<T>::acc;
  const int64_t rows = x.size(0), n = x.size(1);
  const R* xp = reinterpret_cast<const R*>(x.data_ptr());
  const R* rp = res ? reinterpret_cast<const R*>(res->data_ptr()) : nullptr;
  R* hp = rp ? reinterpret_cast<R*>(h.data_ptr()) : nullptr;
  R* yp = reinterpret_cast<R*>(y.data_ptr());
  const A* gp = gain.data_ptr<A>();
  const A* bp = bias ? bias->data_ptr<A>() : nullptr;
  A* sp = stats.data_ptr<A>();
  const A eps = static_cast<A>(eps_d);
  const A div = l2 ? A(1) : static_cast<A>(n);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const R* xr = xp + i * n;
      const R* src = xr;
      if (rp) {  // h = x + residual, rounded to the storage dtype, is both an output and the input
        const R* rr = rp + i * n;
        R* hr = hp + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) hr[j] = IO<T>::st(IO<T>::ld(xr[j]) + IO<T>::ld(rr[j]));
        src = hr;
      }
      A mean = 0;
      if (center) {
        A s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; ++j) s += IO<T>::ld(src[j]);
        mean = s / static_cast<A>(n);
      }
      A ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < n; ++j) {
        A v = IO<T>::ld(src[j]) - mean;
        ss += v * v;
      }
      A r, drdms;
      scale_of<A>(ss / div, eps, eps_mode, r, drdms);
      sp[3 * i] = mean;
      sp[3 * i + 1] = r;
      sp[3 * i + 2] = drdms;
      R* yr = yp + i * n;
      if (before_gain) {  // Llama order: gain * x_hat.to(dtype) (+ bias), each product rounded
        if (bp) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            A t = IO<T>::ld(IO<T>::st((IO<T>::ld(src[j]) - mean) * r));
            yr[j] = IO<T>::st(IO<T>::ld(IO<T>::st(t * gp[j])) + bp[j]);
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            A t = IO<T>::ld(IO<T>::st((IO<T>::ld(src[j]) - mean) * r));
            yr[j] = IO<T>::st(t * gp[j]);
          }
        }
      } else if (bp) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) yr[j] = IO<T>::st((IO<T>::ld(src[j]) - mean) * r * gp[j] + bp[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) yr[j] = IO<T>::st((IO<T>::ld(src[j]) - mean) * r * gp[j]);
      }
    }
  });
}

// One row of the backward; dg / db (may be null) are this thread chunk's partial sums.
template <typename T, typename R, typename A>
inline void bwd_row(const R* __restrict xr, const R* __restrict dyr, const R* __restrict drr, R* __restrict dxr,
                    const A* __restrict gp, A* __restrict pgc, A* __restrict pbc, int64_t n, A mean, A r, A drdms,
                    A div, bool center, bool before_gain) {
  A s_dxh = 0, s_dxh_xc = 0, s_xc = 0;
#pragma omp simd reduction(+ : s_dxh, s_dxh_xc, s_xc)
  for (int64_t j = 0; j < n; ++j) {
    const A xc = IO<T>::ld(xr[j]) - mean;
    const A dxh = IO<T>::ld(dyr[j]) * gp[j];
    s_dxh += dxh;
    s_dxh_xc += dxh * xc;
    s_xc += xc;
  }
  if (pgc && before_gain) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) pgc[j] += IO<T>::ld(dyr[j]) * IO<T>::ld(IO<T>::st((IO<T>::ld(xr[j]) - mean) * r));
  } else if (pgc) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) pgc[j] += IO<T>::ld(dyr[j]) * ((IO<T>::ld(xr[j]) - mean) * r);
  }
  if (pbc) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) pbc[j] += IO<T>::ld(dyr[j]);
  }
  const A k = drdms * A(2) / div * s_dxh_xc;
  const A off = center ? (r * s_dxh + k * s_xc) / static_cast<A>(n) : A(0);
  if (drr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j)
      dxr[j] = IO<T>::st(r * IO<T>::ld(dyr[j]) * gp[j] + k * (IO<T>::ld(xr[j]) - mean) - off + IO<T>::ld(drr[j]));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j)
      dxr[j] = IO<T>::st(r * IO<T>::ld(dyr[j]) * gp[j] + k * (IO<T>::ld(xr[j]) - mean) - off);
  }
}

template <typename T>
void bwd_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gain, const at::Tensor& stats,
              const c10::optional<at::Tensor>& dres, at::Tensor& dx, at::Tensor& dg, at::Tensor& db,
              bool center, bool before_gain, bool l2, bool need_dg, bool need_db) {
  using R = typename IO<T>::raw;
  using A = typename IO<T>::acc;
  const int64_t rows = x.size(0), n = x.size(1);
  const R* xp = reinterpret_cast<const R*>(x.data_ptr());
  const R* dyp = reinterpret_cast<const R*>(dy.data_ptr());
  const R* drp = dres ? reinterpret_cast<const R*>(dres->data_ptr()) : nullptr;
  R* dxp = reinterpret_cast<R*>(dx.data_ptr());
  const A* gp = gain.data_ptr<A>();
  const A* sp = stats.data_ptr<A>();
  const A div = l2 ? A(1) : static_cast<A>(n);
  // one chunk per thread, but none smaller than ~16K elements: tiny inputs stay on one thread
  const int64_t work = std::max<int64_t>(1, rows * n / 16384);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>({rows, work, int64_t(at::get_num_threads())}));
  std::vector<A> pg(need_dg ? chunks * n : 0, A(0)), pb(need_db ? chunks * n : 0, A(0));
  A* pgp = need_dg ? pg.data() : nullptr;
  A* pbp = need_db ? pb.data() : nullptr;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
      A* pgc = pgp ? pgp + c * n : nullptr;
      A* pbc = pbp ? pbp + c * n : nullptr;
      for (int64_t i = r0; i < r1; ++i) {
        bwd_row<T, R, A>(xp + i * n, dyp + i * n, drp ? drp + i * n : nullptr, dxp + i * n, gp, pgc, pbc, n,
                         sp[3 * i], sp[3 * i + 1], sp[3 * i + 2], div, center, before_gain);
      }
    }
  });
  A* dgp = need_dg ? dg.data_ptr<A>() : nullptr;
  A* dbp = need_db ? db.data_ptr<A>() : nullptr;
  for (int64_t c = 0; c < chunks; ++c) {
    if (dgp) {
      const A* src = pgp + c * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dgp[j] += src[j];
    }
    if (dbp) {
      const A* src = pbp + c * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dbp[j] += src[j];
    }
  }
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.dim() == 2 && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(),
              name, " must be a contiguous 2-d tensor shaped and typed like x");
}

}  // namespace

// x: (rows, n) contiguous. gain: (n,) in the accumulation dtype, the multiplier (w or 1 + w).
// Returns y, h (x + residual, or an empty tensor) and stats (rows, 3): mean, rstd, d rstd / d ms.
std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& gain, const c10::optional<at::Tensor>& bias, double eps,
                                 bool center, int64_t eps_mode, bool before_gain, bool l2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d tensor");
  if (residual) check_rows(*residual, x, "residual");
  const auto acc = acc_type(x.scalar_type());
  TORCH_CHECK(gain.scalar_type() == acc && gain.is_contiguous() && gain.numel() == x.size(1), "bad gain");
  if (bias) TORCH_CHECK(bias->scalar_type() == acc && bias->is_contiguous() && bias->numel() == x.size(1), "bad bias");
  auto y = at::empty_like(x);
  auto h = residual ? at::empty_like(x) : at::empty({0}, x.options());
  auto stats = at::empty({x.size(0), 3}, x.options().dtype(acc));
  if (x.size(1) == 0 || x.size(0) == 0) return {y, h, stats.zero_()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_fwd", [&] {
    fwd_impl<scalar_t>(x, residual, gain, bias, y, h, stats, eps, center, eps_mode, before_gain, l2);
  });
  return {y, h, stats};
}

// Returns dx (plus d_residual_out when given), dgain and dbias (accumulation dtype; empty when not needed).
std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gain,
                                 const at::Tensor& stats, const c10::optional<at::Tensor>& dres, bool center,
                                 bool before_gain, bool l2, bool need_dg, bool need_db) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d tensor");
  check_rows(dy, x, "dy");
  if (dres) check_rows(*dres, x, "d_residual");
  const auto acc = acc_type(x.scalar_type());
  auto dx = at::empty_like(x);
  auto opts = x.options().dtype(acc);
  auto dg = need_dg ? at::zeros({x.size(1)}, opts) : at::empty({0}, opts);
  auto db = need_db ? at::zeros({x.size(1)}, opts) : at::empty({0}, opts);
  if (x.size(0) == 0 || x.size(1) == 0) return {dx, dg, db};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_bwd", [&] {
    bwd_impl<scalar_t>(dy, x, gain, stats, dres, dx, dg, db, center, before_gain, l2, need_dg, need_db);
  });
  return {dx, dg, db};
}
