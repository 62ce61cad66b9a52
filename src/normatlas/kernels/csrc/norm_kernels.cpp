// Fused row-wise normalization (RMSNorm / LayerNorm / L2, optional residual add) for CPU: the row kernels.
//
// One kernel serves every channels-last spec the core can hand it: statistics in fp32 (fp64 for
// double inputs), eps inside or outside the sqrt or as a clamp, the gain applied after or before
// the cast back, an optional bias, and an optional residual add whose sum is written out too.
// Each row is read from memory once (it stays in L1/L2 for the later passes) and written once; the
// backward reads x and dy from memory once, writes dx once, and accumulates the gain / bias gradients
// in one partial sum per thread chunk.
//
// This file sees no tensors (norm_ops.cpp does): only ATen's thread pool and the c10 scalar types, so it compiles
// beside the tensor side (norm_kernels.h is the interface). It is the longest of the three: 26.7 s alone on this
// machine with its templates for every dtype, parameter type and flag case (23.7 s before the bf16 backward's lane
// order), norm_ops.cpp 21.0 s, norm_bind.cpp 12.4 s; 31-34 s for the three in parallel on two cores.
#include <ATen/Parallel.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "norm_kernels.h"
#include "norm_rows.h"

// The explicit-vector kernels (norm_cpu_vec.h) on AVX-512 (F, BW, VL) or AVX2 + FMA + F16C; the generic templates
// below elsewhere (other ISAs, or NORMATLAS_NO_VEC defined).
#if ((defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || \
     (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))) &&              \
    !defined(NORMATLAS_NO_VEC)
#define NORMATLAS_VEC 1
#include "norm_cpu_vec.h"
#else
#define NORMATLAS_VEC 0
#endif

namespace {

using namespace normatlas::rows;  // NOLINT: the shared row machinery (norm_rows.h)

#if NORMATLAS_VEC
// The explicit-vector row kernels serve fp32, bf16 and fp16 (fp64 keeps the generic path).
template <typename T> struct Vec { using type = void; };
template <> struct Vec<float> { using type = vec::F32; };
template <> struct Vec<c10::BFloat16> { using type = vec::BF16; };
template <> struct Vec<c10::Half> { using type = vec::F16; };
#endif

// The storage type of each Dtype, called as body(T{}).
template <typename F>
void on_dtype(normatlas::Dtype t, F&& body) {
  switch (t) {
    case normatlas::Dtype::F32: return body(float{});
    case normatlas::Dtype::F64: return body(double{});
    case normatlas::Dtype::BF16: return body(c10::BFloat16{});
    case normatlas::Dtype::F16: return body(c10::Half{});
  }
}

// out[j] = the multiplier (or bias) from p's n values in the accumulation dtype A: w, or 1 + w (with p.round, rounded
// in p's dtype first, as torch's `1 + w` before a cast-before-gain product).
template <typename A>
void convert_param(const normatlas::Param& p, int64_t n, A* out) {
  on_dtype(p.dtype, [&](auto tag) {
    using W = decltype(tag);
    using C = typename IO<W>::acc;  // torch's compute type for W: double for float64, float otherwise
    const auto* w = static_cast<const typename IO<W>::raw*>(p.data);
#if NORMATLAS_VEC
    if constexpr (std::is_same_v<A, float> && !std::is_void_v<typename Vec<W>::type>) {
      using V = typename Vec<W>::type;  // the vector conversions (a shift for bf16, VCVTPH2PS for fp16), 8 at a time
      const auto* pv = reinterpret_cast<const typename V::raw*>(w);
      const __m256 one = _mm256_set1_ps(1.f);
      vec::each8(n, [&](int64_t j, vec::mask8 m) {
        __m256 v = vec::load<V>(pv + j, m);
        if (p.plus_one) v = p.round ? V::rt(_mm256_add_ps(v, one)) : _mm256_add_ps(v, one);
        vec::mask_store_ps(out + j, m, v);
      });
      return;
    }
#endif
    if (!p.plus_one) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<A>(IO<W>::ld(w[j]));
    } else if (p.round) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<A>(IO<W>::ld(IO<W>::st(IO<W>::ld(w[j]) + C(1))));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<A>(IO<W>::ld(w[j])) + A(1);
    }
  });
}

// The gain (slot 0) or bias (slot 1) of `p` in the accumulation dtype A for the calling thread: p's own data when
// it already is A and no 1 + w is asked for, else a copy converted into this thread's buffer for the slot, reused
// from call to call. Each worker converts its own copy: one converted by the caller's
// thread and read by the other workers crossed cores on every call (a 65,536-wide bf16 LayerNorm over 2 rows took
// 87 us on 2 threads against 32 us with fp32 parameters read in place). Without data: ones (a gain of 1), kept
// from call to call in a buffer of their own, or null for a bias.
template <typename A>
const A* resolve(const normatlas::Param& p, int slot, int64_t n, bool bias = false) {
  constexpr auto own = std::is_same_v<A, double> ? normatlas::Dtype::F64 : normatlas::Dtype::F32;
  if (!p.data) {
    if (bias) return nullptr;
    thread_local std::vector<A> ones;
    if (static_cast<int64_t>(ones.size()) < n) ones.resize(static_cast<size_t>(n), A(1));
    return ones.data();
  }
  if (p.dtype == own && !p.plus_one) return static_cast<const A*>(p.data);
  thread_local std::vector<A> buf[2];
  std::vector<A>& b = buf[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
  convert_param<A>(p, n, b.data());
  return b.data();
}

#if NORMATLAS_VEC
template <class V>
constexpr normatlas::Dtype dtype_of_vec() {
  if constexpr (std::is_same_v<V, vec::BF16>) return normatlas::Dtype::BF16;
  else if constexpr (std::is_same_v<V, vec::F16>) return normatlas::Dtype::F16;
  else return normatlas::Dtype::F32;
}

// The gain (slot 0) or bias (slot 1) as the P-typed row the vector kernels read: V's own data, fp32 (resolve), or
// none (NoGain).
template <class P>
const typename P::raw* param_row(const normatlas::Param& p, int slot, int64_t n, bool bias = false) {
  if constexpr (std::is_same_v<P, vec::F32>) return resolve<float>(p, slot, n, bias);
  else if constexpr (std::is_same_v<P, vec::NoGain>) return nullptr;
  else return static_cast<const typename P::raw*>(p.data);
}

// Up to this many rows a thread reads a half-precision model's own gain and bias in their dtype (no converted copy);
// over more, it converts them to fp32 once. The half-precision output pass is bound by its conversions, so each
// row pays for converting the gain again: bf16 RMSNorm with the gain read in bf16 took 1.01-1.05x the time of an
// fp32 gain read in place over 1-4 rows of 4096 and 1.12-1.14x over 16-64 (1 thread, ad-hoc medians), while one
// conversion of a 4096-wide gain costs ~0.3 us (a decode step's 1 x 4096 RMSNorm: 4.84 us converting, 4.54 us
// reading bf16). Many rows at once (prefill, training) therefore convert; decode and a few very wide rows do not.
constexpr int64_t kNativeRows = 4;

// Calls body(P{}) with the type this thread's `rows` rows read the parameters in: NoGain with neither a gain nor a
// bias; V itself (half precision V, when `Native`) for a gain in V's dtype without 1 + w, a bias absent or in V's
// dtype too (`bias_native`), over at most kNativeRows rows; else F32 (read in place or converted by this thread).
// The backward is never Native: a few rows of training are rare, and its kernels for a third parameter type took
// ~5 s of the build.
template <class V, bool Native = true, typename F>
void with_param_type(const normatlas::Param& gain, bool bias, bool bias_native, int64_t rows, F&& body) {
  if (!gain.data && !bias) return body(vec::NoGain{});
  if constexpr (Native && !std::is_same_v<V, vec::F32>) {
    if (rows <= kNativeRows && gain.data && gain.dtype == dtype_of_vec<V>() && !gain.plus_one && bias_native) {
      return body(V{});
    }
  }
  body(vec::F32{});
}

// Rows of at most this many bytes take their statistics 8 rows at a time (vec::row_stats8).
constexpr int64_t kGroupRowBytes = 2048;

template <class V>
void fwd_impl_v(const typename V::raw* xp, const typename V::raw* rp, typename V::raw* hp, typename V::raw* yp,
                const normatlas::Param& gain, const normatlas::Param& bias, float* sp, int64_t rows, int64_t n,
                double eps_d, bool center, int64_t eps_mode, bool before_gain, bool l2, bool parallel,
                int64_t problem_rows) {
  using R = typename V::raw;
  const float eps = static_cast<float>(eps_d);
  const float div = l2 ? 1.f : static_cast<float>(n);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  const bool stream = streams_from_memory(problem_rows * n * static_cast<int64_t>(sizeof(R)) * (rp ? 2 : 1));
  const bool nt = stream && streaming_stores(yp, n * static_cast<int64_t>(sizeof(R)),
                                             rows * n * static_cast<int64_t>(sizeof(R)));
  const bool has_bias = bias.data != nullptr, bias_native = !has_bias || bias.dtype == gain.dtype;
  const bool grouped = n * static_cast<int64_t>(sizeof(R)) <= kGroupRowBytes;
  over_rows(parallel, rows, grain, [&](int64_t begin, int64_t end) {
    with_param_type<V>(gain, has_bias, bias_native, end - begin, [&](auto p_tag) {
      using P = decltype(p_tag);
      const auto write = vec::pick_writer<V, P>(center, before_gain, has_bias);
      const auto* gp = param_row<P>(gain, 0, n);
      const auto* bp = param_row<P>(bias, 1, n, true);
      if (grouped && write.group) {  // short rows: the statistics of 8 rows at a time, then their outputs
        for (int64_t i = begin; i < end; i += 8) {
          const int64_t rows_g = std::min<int64_t>(8, end - i);
          const int64_t ahead = stream ? std::min<int64_t>(8, end - i - rows_g) : 0;
          write.group(xp + i * n, rp ? rp + i * n : nullptr, rp ? hp + i * n : nullptr, yp + i * n, gp, bp, sp + 3 * i,
                      rows_g, n, eps, div, eps_mode, ahead, nt);
        }
        return;
      }
      for (int64_t i = begin; i < end; ++i) {
        const R* xr = xp + i * n;
        const R* rr = rp ? rp + i * n : nullptr;
        R* hr = rp ? hp + i * n : nullptr;
        vec::row_stats8<V>(xr, rr, hr, n, 1, center, eps, div, eps_mode, sp + 3 * i);
        const bool more = stream && i + 1 < end;
        write.row(rp ? hr : xr, yp + i * n, gp, bp, sp[3 * i], sp[3 * i + 1], n, more ? xr + n : nullptr,
                  more && rp ? rr + n : nullptr, nt);
      }
    });
    if (nt) _mm_sfence();  // order this thread's streaming stores before the result is handed back
  });
}

// The gain as the bf16 backward reads its whole 16-element blocks (vec::kLaneOrder: per block elements 0-3, 8-11, 4-7,
// 12-15; the tail after the last whole block in order), in this thread's buffer; g itself for the other types and
// without a gain. ~1 us for a 4096-wide gain, once a call.
template <class V, class P>
const typename P::raw* lane_order_gain(const typename P::raw* g, int64_t n) {
  if constexpr (vec::kLaneOrder<V> && std::is_same_v<P, vec::F32>) {
    if (!g) return g;
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
    std::copy(g, g + n, buf.data());
    vec::swap_block_halves(buf.data(), n);
    return buf.data();
  } else {
    (void)n;
    return g;
  }
}

// The backward's tiles: from cache, blocks of kTileRows rows, their second pass in strips of kTileCols columns.
// Builds interleaved in one process (backward alone, 2 threads, 256 x 4096, 512 x 2048, 128 x 8192 and 1024 x 1024,
// fp32 and bf16, RMSNorm and LayerNorm): 16 x 1024 took 0.72-1.02x the row-by-row time, 8 x 1024 0.75-1.09x,
// 4 x 1024 0.78-1.17x, 8 x 512 0.72-1.16x, 8 x 2048 0.83-1.09x. A block of 16 rows of x and dy at 4096 fp32 is 512
// KiB, within a 1 MiB L2. With gain / bias gradients the second pass walks chunks of vec::kChunk columns down the
// block's rows instead, the chunk's partial sums in registers (vec::bwd_chunk); against the strips (bit for bit the
// same results, builds interleaved, backward alone, 2 threads, 256 x 4096, 512 x 2048, 128 x 8192, 1024 x 1024,
// 4096 x 256, 16,384 x 64, fp32 / bf16): LayerNorm 0.53-1.04x the time, fp32 RMSNorm 0.79-1.08x, bf16 RMSNorm, bound
// by its conversions, level (1.02x on one thread at 4096 x 256 and 1024 x 1024, 0.75-1.33x medians on two).
constexpr int64_t kTileRows = 16, kTileCols = 1024;

// Rows [r0, r1) of the backward with the vector kernels; pg / pb: this chunk's gain / bias partial sums (may be
// null). From cache (`stream` false): per block of kTileRows rows, first their row sums, then the second pass down
// the block's rows a few columns at a time: with gain / bias gradients in chunks of vec::kChunk columns and then one
// vector at a time (bwd_chunk, bwd_narrow), their partial sums in registers; without, in strips of kTileCols
// columns, so a strip's gain stays in L1 while the block's rows pass through it. Row by row, x, dy, the gain and two
// partial-sum rows came back from L2 for every row (80 KiB a row at 4096 fp32, against a 32 KiB L1). Same arithmetic
// in the same order: bit for bit the row-by-row results. From memory: row by row, each second pass prefetching the
// next row.
// `gl`: the gain in the bf16 backward's lane order (lane_order_gain), g itself for the other types.
template <class V, class P, bool C, int G, bool Bs, bool DR>
void bwd_rows_v(const typename V::raw* xp, const typename V::raw* dyp, const typename V::raw* drp,
                typename V::raw* dxp, const typename P::raw* g, const typename P::raw* gl, float* pg, float* pb,
                const float* sp, int64_t n, float div, int64_t r0, int64_t r1, bool stream, bool nt) {
  using R = typename V::raw;
  if (stream) {
    for (int64_t i = r0; i < r1; ++i) {
      const bool more = i + 1 < r1;
      vec::bwd_row<V, P, C, G, Bs, DR>(xp + i * n, dyp + i * n, DR ? drp + i * n : nullptr, dxp + i * n, g, gl, pg,
                                       pb, n, sp[3 * i], sp[3 * i + 1], sp[3 * i + 2], div,
                                       more ? xp + (i + 1) * n : nullptr, more ? dyp + (i + 1) * n : nullptr,
                                       more && DR ? drp + (i + 1) * n : nullptr, nt);
    }
    return;
  }
  float k[kTileRows], off[kTileRows];
  for (int64_t b0 = r0; b0 < r1; b0 += kTileRows) {
    const int64_t b1 = std::min(r1, b0 + kTileRows);
    for (int64_t i = b0; i < b1; ++i) {
      vec::bwd_sums<V, P, C, 0, false>(xp + i * n, dyp + i * n, g, gl, nullptr, nullptr, n, sp[3 * i],
                                       sp[3 * i + 1], sp[3 * i + 2], div, k[i - b0], off[i - b0]);
    }
    // with gain / bias sums to accumulate: chunks of vec::kChunk columns, the sums in registers over the block's rows
    const int64_t chunked = (G || Bs) ? n / vec::kChunk * vec::kChunk : 0;
    for (int64_t j0 = 0; j0 < chunked; j0 += vec::kChunk) {
      vec::bwd_chunk<V, P, C, G, Bs, DR>(xp + b0 * n, dyp + b0 * n, DR ? drp + b0 * n : nullptr, dxp + b0 * n, n,
                                         b1 - b0, gl, pg, pb, j0, sp + 3 * b0, k, off);
    }
    if constexpr (G || Bs) {  // the columns after the chunks (all of a short row's), a vector at a time down the rows
      vec::bwd_narrow<V, P, C, G, Bs, DR>(xp + b0 * n, dyp + b0 * n, DR ? drp + b0 * n : nullptr, dxp + b0 * n, n,
                                          b1 - b0, g, pg, pb, chunked, n, sp + 3 * b0, k, off);
      continue;
    }
    for (int64_t j0 = 0; j0 < n; j0 += kTileCols) {
      const int64_t j1 = std::min(n, j0 + kTileCols);
      for (int64_t i = b0; i < b1; ++i) {
        const R* x = xp + i * n;
        vec::bwd_cols<V, P, C, 0, false, DR>(x, dyp + i * n, DR ? drp + i * n : nullptr, dxp + i * n, g, nullptr,
                                             nullptr, j0, j1, sp[3 * i], sp[3 * i + 1], k[i - b0], off[i - b0], nullptr,
                                             nullptr, nullptr, false);
      }
    }
  }
}

template <class V, class P>
using BwdRowsFn = void (*)(const typename V::raw*, const typename V::raw*, const typename V::raw*, typename V::raw*,
                           const typename P::raw*, const typename P::raw*, float*, float*, const float*, int64_t,
                           float, int64_t, int64_t, bool, bool);

// The rows function for the flags; gain: 0 (no gain gradient), vec::kGain or vec::kGainBeforeCast.
template <class V, class P, int G>
BwdRowsFn<V, P> pick_bwd_rows_g(bool center, bool b, bool dr) {
  switch ((center ? 4 : 0) | (b ? 2 : 0) | (dr ? 1 : 0)) {
    case 0: return bwd_rows_v<V, P, false, G, false, false>;
    case 1: return bwd_rows_v<V, P, false, G, false, true>;
    case 2: return bwd_rows_v<V, P, false, G, true, false>;
    case 3: return bwd_rows_v<V, P, false, G, true, true>;
    case 4: return bwd_rows_v<V, P, true, G, false, false>;
    case 5: return bwd_rows_v<V, P, true, G, false, true>;
    case 6: return bwd_rows_v<V, P, true, G, true, false>;
    default: return bwd_rows_v<V, P, true, G, true, true>;
  }
}

template <class V, class P>
BwdRowsFn<V, P> pick_bwd_rows(bool center, int gain, bool b, bool dr) {
  if constexpr (std::is_same_v<P, vec::NoGain>) {  // no gain or bias gradients to accumulate
    if (center) return dr ? bwd_rows_v<V, P, true, 0, false, true> : bwd_rows_v<V, P, true, 0, false, false>;
    return dr ? bwd_rows_v<V, P, false, 0, false, true> : bwd_rows_v<V, P, false, 0, false, false>;
  }
  if constexpr (!std::is_same_v<V, vec::F32>) {  // in fp32 the cast before the gain rounds nothing
    if (gain == vec::kGainBeforeCast) return pick_bwd_rows_g<V, P, vec::kGainBeforeCast>(center, b, dr);
  }
  if (gain) return pick_bwd_rows_g<V, P, vec::kGain>(center, b, dr);
  return pick_bwd_rows_g<V, P, 0>(center, b, dr);
}
#endif

template <typename T>
void fwd_impl(const typename IO<T>::raw* xp, const typename IO<T>::raw* rp, typename IO<T>::raw* hp,
              typename IO<T>::raw* yp, const normatlas::Param& gain, const normatlas::Param& bias,
              typename IO<T>::acc* sp, int64_t rows, int64_t n, double eps_d, bool center, int64_t eps_mode,
              bool before_gain, bool l2, bool parallel = true, int64_t problem_rows = -1) {
  using R = typename IO<T>::raw;
  using A = typename IO<T>::acc;
  // whether the input streams from memory is a property of the whole problem, not of a caller's share of its rows
  if (problem_rows < 0) problem_rows = rows;
#if NORMATLAS_VEC
  if constexpr (!std::is_void_v<typename Vec<T>::type>) {
    using V = typename Vec<T>::type;
    using VR = typename V::raw;
    fwd_impl_v<V>(reinterpret_cast<const VR*>(xp), reinterpret_cast<const VR*>(rp), reinterpret_cast<VR*>(hp),
                  reinterpret_cast<VR*>(yp), gain, bias, sp, rows, n, eps_d, center, eps_mode, before_gain, l2,
                  parallel, problem_rows);
    return;
  }
#endif
  const A eps = static_cast<A>(eps_d);
  const A div = l2 ? A(1) : static_cast<A>(n);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  // Prefetch the next row only when the input comes from memory: for a cache-resident input the hardware
  // prefetcher suffices and the extra instructions cost more than they save (measured: 256 x 4096 fp32).
  const bool stream = streams_from_memory(problem_rows * n * static_cast<int64_t>(sizeof(R)) * (rp ? 2 : 1));
  over_rows(parallel, rows, grain, [&](int64_t begin, int64_t end) {
    const A* gp = resolve<A>(gain, 0, n);
    const A* bp = resolve<A>(bias, 1, n, true);
    for (int64_t i = begin; i < end; ++i) {
      const R* xr = xp + i * n;
      const R* src = xr;
      A mean = 0, ss = 0;
      if (rp) {  // h = x + residual, rounded to the storage dtype, is both an output and the input
        const R* rr = rp + i * n;
        R* hr = hp + i * n;
        src = hr;
        auto h_at = [&](int64_t j) {  // writes h[j] and returns it as read back
          const R hv = IO<T>::st(IO<T>::ld(xr[j]) + IO<T>::ld(rr[j]));
          hr[j] = hv;
          return IO<T>::ld(hv);
        };
        if (center) {
          row_moments<A>(n, h_at, [&](int64_t j) { return IO<T>::ld(hr[j]); }, mean, ss);
        } else {
          ss = lane_sum<A>(n, [&](int64_t j) { const A v = h_at(j); return v * v; });
        }
      } else if (center) {
        const auto at = [&](int64_t j) { return static_cast<A>(IO<T>::ld(src[j])); };
        row_moments<A>(n, at, at, mean, ss);
      } else {
        ss = lane_sum<A>(n, [&](int64_t j) {
          const A v = IO<T>::ld(src[j]);
          return v * v;
        });
      }
      A r, drdms;
      scale_of<A>(ss / div, eps, eps_mode, r, drdms);
      sp[3 * i] = mean;
      sp[3 * i + 1] = r;
      sp[3 * i + 2] = drdms;
      R* yr = yp + i * n;
      // while this row is written from cache, the next row's input streams in from memory
      const bool more = stream && i + 1 < end;
      const R* nx = more ? xr + n : nullptr;
      const R* nr = more && rp ? rp + (i + 1) * n : nullptr;
      if (before_gain) {  // Llama order: gain * x_hat.to(dtype) (+ bias), each product rounded
        if (bp) {
          blocked(n, nx, nr, [&](int64_t jb, int64_t je) {
#pragma omp simd
            for (int64_t j = jb; j < je; ++j) {
              A t = IO<T>::ld(IO<T>::st((IO<T>::ld(src[j]) - mean) * r));
              yr[j] = IO<T>::st(IO<T>::ld(IO<T>::st(t * gp[j])) + bp[j]);
            }
          });
        } else {
          blocked(n, nx, nr, [&](int64_t jb, int64_t je) {
#pragma omp simd
            for (int64_t j = jb; j < je; ++j) {
              A t = IO<T>::ld(IO<T>::st((IO<T>::ld(src[j]) - mean) * r));
              yr[j] = IO<T>::st(t * gp[j]);
            }
          });
        }
      } else if (bp) {
        blocked(n, nx, nr, [&](int64_t jb, int64_t je) {
#pragma omp simd
          for (int64_t j = jb; j < je; ++j) yr[j] = IO<T>::st((IO<T>::ld(src[j]) - mean) * r * gp[j] + bp[j]);
        });
      } else {
        blocked(n, nx, nr, [&](int64_t jb, int64_t je) {
#pragma omp simd
          for (int64_t j = jb; j < je; ++j) yr[j] = IO<T>::st((IO<T>::ld(src[j]) - mean) * r * gp[j]);
        });
      }
    }
  });
}

// One row of the backward; dg / db (may be null) are this thread chunk's partial sums.
template <typename T, typename R, typename A>
inline void bwd_row(const R* __restrict xr, const R* __restrict dyr, const R* __restrict drr, R* __restrict dxr,
                    const A* __restrict gp, A* __restrict pgc, A* __restrict pbc, int64_t n, A mean, A r, A drdms,
                    A div, bool center, bool before_gain) {
  // First pass (x and dy come from memory here): the row sums, and in the training case (gain after the
  // cast) the gain / bias partial sums too, so the second pass only reads the now cached row. A row wider than
  // rows::kSumBlock is summed a block at a time, the block sums added pairwise in fp64 (rows::over_blocks).
  auto first_pass = [&](auto acc_g, auto acc_b, auto lanes, int64_t jb, int64_t je) {
    constexpr bool G = decltype(acc_g)::value, B = decltype(acc_b)::value;
    constexpr int64_t K = decltype(lanes)::value;
    A a1[K] = {}, a2[K] = {}, a3[K] = {};  // K independent partial sums each, so the adds pipeline
    A s1 = 0, s2 = 0, s3 = 0;
    int64_t j0 = jb;
    for (; j0 + K <= je; j0 += K) {
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const A dy = IO<T>::ld(dyr[j0 + k]);
        const A xc = IO<T>::ld(xr[j0 + k]) - mean;
        const A dxh = dy * gp[j0 + k];
        a1[k] += dxh;
        a2[k] += dxh * xc;
        a3[k] += xc;
        if constexpr (G) pgc[j0 + k] += dy * (xc * r);
        if constexpr (B) pbc[j0 + k] += dy;
      }
    }
    for (int64_t j = j0; j < je; ++j) {
      const A dy = IO<T>::ld(dyr[j]);
      const A xc = IO<T>::ld(xr[j]) - mean;
      const A dxh = dy * gp[j];
      s1 += dxh;
      s2 += dxh * xc;
      s3 += xc;
      if constexpr (G) pgc[j] += dy * (xc * r);
      if constexpr (B) pbc[j] += dy;
    }
    for (int64_t k = 0; k < K; ++k) {
      s1 += a1[k];
      s2 += a2[k];
      s3 += a3[k];
    }
    return std::array<A, 3>{s1, s2, s3};
  };
  using yes = std::true_type;
  using no = std::false_type;
  const bool fused = pgc && !before_gain;
  A s_dxh, s_dxh_xc, s_xc;
  with_lanes(n, [&](auto lanes) {  // as lane_sum: 64 lanes for rows of 256 or more, 8 below
    auto block = [&](int64_t jb, int64_t je) {
      if (fused && pbc) return first_pass(yes{}, yes{}, lanes, jb, je);
      if (fused) return first_pass(yes{}, no{}, lanes, jb, je);
      return first_pass(no{}, no{}, lanes, jb, je);
    };
    if (n <= normatlas::rows::kSumBlock) {
      const auto s = block(0, n);
      s_dxh = s[0];
      s_dxh_xc = s[1];
      s_xc = s[2];
    } else {
      double s[3];
      normatlas::rows::over_blocks<3>(n, block, s);
      s_dxh = static_cast<A>(s[0]);
      s_dxh_xc = static_cast<A>(s[1]);
      s_xc = static_cast<A>(s[2]);
    }
  });
  const A k = drdms * A(2) / div * s_dxh_xc;
  const A off = center ? (r * s_dxh + k * s_xc) / static_cast<A>(n) : A(0);
  if (!fused) {
    if (pgc && before_gain) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j)
        pgc[j] += IO<T>::ld(dyr[j]) * IO<T>::ld(IO<T>::st((IO<T>::ld(xr[j]) - mean) * r));
    }
    if (pbc) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) pbc[j] += IO<T>::ld(dyr[j]);
    }
  }
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
void bwd_impl(const typename IO<T>::raw* dyp, const typename IO<T>::raw* xp, const typename IO<T>::raw* drp,
              typename IO<T>::raw* dxp, const normatlas::Param& gain, const typename IO<T>::acc* sp,
              typename IO<T>::acc* dgp, typename IO<T>::acc* dbp, int64_t rows, int64_t n, bool center,
              bool before_gain, bool l2) {
  using R = typename IO<T>::raw;
  using A = typename IO<T>::acc;
  const bool need_dg = dgp != nullptr, need_db = dbp != nullptr;
  const A div = l2 ? A(1) : static_cast<A>(n);
  // one chunk per thread, but none smaller than ~16K elements: tiny inputs stay on one thread
  const int64_t work = std::max<int64_t>(1, rows * n / 16384);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>({rows, work, int64_t(at::get_num_threads())}));
  const bool stream = streams_from_memory(rows * n * static_cast<int64_t>(sizeof(R)) * (drp ? 3 : 2));
  [[maybe_unused]] const bool nt = stream && streaming_stores(dxp, n * static_cast<int64_t>(sizeof(R)),
                                                               rows * n * static_cast<int64_t>(sizeof(R)));
  // Partial gain / bias sums per chunk (a single chunk accumulates straight into the zeroed outputs), each chunk's row
  // on 64-byte lines of its own: rows sharing a line made every row's update by one thread evict the line from the
  // other's cache (the 16-wide fp32 LayerNorm backward of 8 M elements took 41.7 ms, with lines of their own 4.2).
  constexpr int64_t kLineA = 64 / static_cast<int64_t>(sizeof(A));
  const int64_t stride = (n + kLineA - 1) / kLineA * kLineA;
  const int64_t per = chunks > 1 ? chunks * stride : 0;
  std::vector<A> partial((need_dg ? per : 0) + (need_db ? per : 0) + kLineA, A(0));
  A* base = partial.data() + (kLineA - (reinterpret_cast<uintptr_t>(partial.data()) / sizeof(A)) % kLineA) % kLineA;
  A* pgp = need_dg ? (chunks > 1 ? base : dgp) : nullptr;
  A* pbp = need_db ? (chunks > 1 ? base + (need_dg ? per : 0) : dbp) : nullptr;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
#if NORMATLAS_VEC
    if constexpr (!std::is_void_v<typename Vec<T>::type>) {
      using V = typename Vec<T>::type;
      using VR = typename V::raw;
      auto chunks_v = [&](auto p_tag) {  // the gain read in P (with_param_type)
        using P = decltype(p_tag);
        const auto* gp = param_row<P>(gain, 0, n);
        const auto* gl = lane_order_gain<V, P>(gp, n);
        for (int64_t c = cb; c < ce; ++c) {
          const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
          A* pgc = pgp ? pgp + c * stride : nullptr;
          A* pbc = pbp ? pbp + c * stride : nullptr;
          const int gain_grad = !pgc ? 0 : before_gain ? vec::kGainBeforeCast : vec::kGain;
          const auto rows_fn = pick_bwd_rows<V, P>(center, gain_grad, pbc != nullptr, drp != nullptr);
          rows_fn(reinterpret_cast<const VR*>(xp), reinterpret_cast<const VR*>(dyp), reinterpret_cast<const VR*>(drp),
                  reinterpret_cast<VR*>(dxp), gp, gl, pgc, pbc, sp, n, div, r0, r1, stream, nt);
          if constexpr (vec::kLaneOrder<V>) {  // the row-by-row path's partial sums were kept in the lane order
            if (stream && pgc) vec::swap_block_halves(pgc, n);
            if (stream && pbc) vec::swap_block_halves(pbc, n);
          }
        }
        if (nt) _mm_sfence();
      };
      with_param_type<V, false>(gain, dbp != nullptr, true, rows * ce / chunks - rows * cb / chunks, chunks_v);
      return;
    }
#endif
    const A* gp = resolve<A>(gain, 0, n);
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
      A* pgc = pgp ? pgp + c * stride : nullptr;
      A* pbc = pbp ? pbp + c * stride : nullptr;
      for (int64_t i = r0; i < r1; ++i) {
        bwd_row<T, R, A>(xp + i * n, dyp + i * n, drp ? drp + i * n : nullptr, dxp + i * n, gp, pgc, pbc, n,
                         sp[3 * i], sp[3 * i + 1], sp[3 * i + 2], div, center, before_gain);
      }
    }
  });
  for (int64_t c = 0; c < chunks && chunks > 1; ++c) {
    if (dgp) {
      const A* src = pgp + c * stride;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dgp[j] += src[j];
    }
    if (dbp) {
      const A* src = pbp + c * stride;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dbp[j] += src[j];
    }
  }
}

// The output pass alone, y = x * s * weight row by row (no statistics): the floor under any norm forward on this
// machine, timed by the benchmark suite next to a copy. Same threading, allocation and vector code as the forward.
template <typename T>
void affine_floor_impl(const typename IO<T>::raw* xp, typename IO<T>::raw* yp, const normatlas::Param& gain, float sc,
                       int64_t rows, int64_t n) {
  // the forward's store policy: streaming stores for an input from memory into already mapped pages
  const int64_t bytes = rows * n * static_cast<int64_t>(sizeof(typename IO<T>::raw));
  const bool stream = streams_from_memory(bytes) && streaming_stores(yp, n * static_cast<int64_t>(sizeof(*yp)), bytes);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
#if NORMATLAS_VEC
    if constexpr (!std::is_void_v<typename Vec<T>::type>) {
      using V = typename Vec<T>::type;
      using VR = typename V::raw;
      auto rows_v = [&](auto p_tag) {  // the gain read as the forward reads it
        using P = decltype(p_tag);
        const auto* g = param_row<P>(gain, 0, n);
        for (int64_t i = begin; i < end; ++i) {
          vec::write_row<V, P, false, false, false>(reinterpret_cast<const VR*>(xp + i * n),
                                                       reinterpret_cast<VR*>(yp + i * n), g, nullptr, 0.f, sc, n,
                                                       nullptr, nullptr, stream);
        }
        if (stream) _mm_sfence();
      };
      with_param_type<V>(gain, false, true, end - begin, rows_v);
      return;
    }
#endif
    const float* g = resolve<float>(gain, 0, n);
    for (int64_t i = begin; i < end; ++i) {
      const auto* xr = xp + i * n;
      auto* yr = yp + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = IO<T>::st(IO<T>::ld(xr[j]) * sc * g[j]);
    }
  });
}

}  // namespace

namespace normatlas {

void forward(Dtype t, const void* x, const void* res, void* h, void* y, const Param& gain, const Param& bias,
             void* stats, int64_t rows, int64_t n, const RowFlags& f, bool parallel) {
  on_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    using R = typename IO<T>::raw;
    using A = typename IO<T>::acc;
    fwd_impl<T>(static_cast<const R*>(x), static_cast<const R*>(res), static_cast<R*>(h), static_cast<R*>(y),
                gain, bias, static_cast<A*>(stats), rows, n, f.eps,
                f.center, f.eps_mode, f.before_gain, f.l2, parallel);
  });
}

void backward(Dtype t, const void* dy, const void* x, const void* dres, void* dx, const Param& gain,
              const void* stats, void* dgain, void* dbias, int64_t rows, int64_t n, const RowFlags& f) {
  on_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    using R = typename IO<T>::raw;
    using A = typename IO<T>::acc;
    bwd_impl<T>(static_cast<const R*>(dy), static_cast<const R*>(x), static_cast<const R*>(dres), static_cast<R*>(dx),
                gain, static_cast<const A*>(stats), static_cast<A*>(dgain),
                static_cast<A*>(dbias), rows, n, f.center, f.before_gain, f.l2);
  });
}

// Inside the region each fwd_impl call runs in its thread on its share of the rows of q, then of k (so the two gains
// may share a thread's conversion buffer: q's rows are done when k's gain is converted).
void forward_pair(Dtype t, const void* q, const void* k, void* yq, void* yk, const Param& gq, const Param& gk,
                  void* stats, int64_t rq, int64_t rk, int64_t n, const RowFlags& f) {
  on_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    using R = typename IO<T>::raw;
    using A = typename IO<T>::acc;
    const R* qp = static_cast<const R*>(q);
    const R* kp = static_cast<const R*>(k);
    R* yqp = static_cast<R*>(yq);
    R* ykp = static_cast<R*>(yk);
    A* sp = static_cast<A*>(stats);
    const Param no_bias{nullptr, t, false, false};
    at::parallel_for(0, rq + rk, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
      if (b < rq) {
        const int64_t e1 = std::min(e, rq);
        fwd_impl<T>(qp + b * n, nullptr, nullptr, yqp + b * n, gq, no_bias, sp + 3 * b, e1 - b, n, f.eps, f.center,
                    f.eps_mode, f.before_gain, f.l2, false, rq + rk);
      }
      if (e > rq) {
        const int64_t b1 = std::max(b, rq) - rq;
        fwd_impl<T>(kp + b1 * n, nullptr, nullptr, ykp + b1 * n, gk, no_bias, sp + 3 * (rq + b1), e - rq - b1, n,
                    f.eps, f.center, f.eps_mode, f.before_gain, f.l2, false, rq + rk);
      }
    });
  });
}

void affine_floor_rows(Dtype t, const void* x, void* y, const Param& g, float s, int64_t rows, int64_t n) {
  on_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      using R = typename IO<T>::raw;
      affine_floor_impl<T>(static_cast<const R*>(x), static_cast<R*>(y), g, s, rows, n);
    }
  });
}

const char* vector_kernels() {
#if NORMATLAS_VEC && NORMATLAS_VEC512
  return "avx512";
#elif NORMATLAS_VEC
  return "avx2";
#else
  return "";
#endif
}

// A fresh output of 8 MiB or more (its pages not yet mapped: a new mmap from the allocator, as glibc gives for
// blocks over its 32 MiB heap limit) asks for transparent huge pages on its 2 MiB-aligned interior before the first
// write. Each 4 KiB page of a fresh mapping otherwise costs a fault and a zeroing as the kernel writes it, which took
// most of a 32 MiB forward's time here; huge pages take one fault per 2 MiB. Advice only (THP in "madvise" or
// "always" mode; elsewhere nothing changes), on memory this output owns; NORMATLAS_HUGEPAGES=0 turns it off.
void advise_output(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    const char* e = std::getenv("NORMATLAS_HUGEPAGES");
    return !(e && e[0] == '0' && e[1] == '\0');
  }();
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!enabled || bytes < int64_t(4 * kHuge)) return;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (e <= a || pages_mapped(reinterpret_cast<void*>(a), static_cast<int64_t>(e - a))) return;
  (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);  // on failure the pages stay 4 KiB
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace normatlas
