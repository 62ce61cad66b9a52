// The row machinery the kernels share (norm_kernels.cpp): loads and stores in each storage dtype with fp32 (fp64)
// arithmetic, lane-parallel row sums, the LayerNorm moments, the eps placements, when a row streams from memory
// and when streaming stores may write it, and the thread-pool split over rows. Plain C++ plus ATen's thread pool and
// the c10 scalar types; no tensors.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "norm_kernels.h"

namespace normatlas::rows {


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

// Row reductions keep K partial sums so consecutive adds do not wait on each other (a single accumulator would
// make every row latency-bound): K = 64 (four AVX-512 vectors of fp32) for rows of 256 or more, K = 8 for shorter
// ones, where zeroing and folding 64 lanes three times a row cost more than the row (64-wide rows ran at 0.4x
// torch's LayerNorm in the generic build).
constexpr int64_t L = 64;

// s plus the sum of K lane sums. The 64 lanes of rows of 256 or more fold as a tree of halves, each level one vector
// add (one lane after another, 64 adds waited on each other); the 8 of shorter rows one after another, which was
// faster than a tree there.
template <int64_t K, typename A>
inline A fold_lanes(A s, A* acc) {
  if constexpr (K >= 64) {
    for (int64_t w = K / 2; w >= 1; w /= 2) {
#pragma omp simd
      for (int64_t k = 0; k < w; ++k) acc[k] += acc[k + w];
    }
    return s + acc[0];
  } else {
    for (int64_t k = 0; k < K; ++k) s += acc[k];
    return s;
  }
}

// Wide rows: a row of more than kSumBlock elements is summed a block at a time, each block in K lanes as a row of one
// block is, and the block sums added pairwise in fp64 (Cascade). Summed in K lanes from start to end, each lane added
// n / K values one after another and the error grew with n (the vector kernels had the same problem: norm_cpu_vec.h's
// Wide). 4096 elements is 64 adds a lane of 64, and keeps a block's fold (the tree of halves) ~2% of its adds; rows up
// to one block are summed as before, bit for bit.
constexpr int64_t kSumBlock = 64 * L;

// A pairwise sum of block sums, in fp64: part[l] holds the sum of 2^l blocks while bit l of `count` is set (a binary
// counter), so each block sum passes through at most log2(blocks) adds of comparable magnitudes.
struct Cascade {
  double part[64];
  int64_t count = 0;
  inline void add(double s) {
    int l = 0;
    for (int64_t c = count; c & 1; c >>= 1, ++l) s = part[l] + s;
    part[l] = s;
    ++count;
  }
  inline double sum() const {
    double s = 0;
    for (int l = 0; l < 64; ++l) {
      if ((count >> l) & 1) s = part[l] + s;
    }
    return s;
  }
};

// Calls block(jb, je) over the blocks of a row of n and returns the Cascade of what each returns (one or more sums).
template <int S, typename F>
inline void over_blocks(int64_t n, F&& block, double* out) {
  Cascade c[S];
  for (int64_t jb = 0; jb < n; jb += kSumBlock) {
    const auto b = block(jb, std::min(n, jb + kSumBlock));
    for (int t = 0; t < S; ++t) c[t].add(static_cast<double>(b[t]));
  }
  for (int t = 0; t < S; ++t) out[t] = c[t].sum();
}

// The sum of f(j) over [j0, j1) in K lanes.
template <int64_t K, typename A, typename F>
inline A lane_sum_range(int64_t j0, int64_t j1, F& f) {
  A acc[K] = {};
  int64_t j = j0;
  for (; j + K <= j1; j += K) {
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) acc[k] += f(j + k);
  }
  A s = 0;
  for (; j < j1; ++j) s += f(j);
  return fold_lanes<K>(s, acc);
}

template <int64_t K, typename A, typename F>
inline A lane_sum_k(int64_t n, F f) {
  if (n <= kSumBlock) return lane_sum_range<K, A>(0, n, f);
  double s;
  over_blocks<1>(n, [&](int64_t jb, int64_t je) { return std::array<A, 1>{lane_sum_range<K, A>(jb, je, f)}; }, &s);
  return static_cast<A>(s);
}

// Calls body(std::integral_constant<int64_t, K>{}) with the lane count for a row of n.
template <typename F>
inline decltype(auto) with_lanes(int64_t n, F&& body) {
  if (n >= 4 * L) return body(std::integral_constant<int64_t, L>{});
  return body(std::integral_constant<int64_t, 8>{});
}

template <typename A, typename F>
inline A lane_sum(int64_t n, F f) {
  return with_lanes(n, [&](auto k) { return lane_sum_k<decltype(k)::value, A>(n, f); });
}

// Two row sums at once over [j0, j1), of e and of e^2 for e = f(j) (the deviation pass of the moments below).
template <int64_t K, typename A, typename F>
inline std::array<A, 2> lane_sum2_range(int64_t j0, int64_t j1, F& f) {
  A a1[K] = {}, a2[K] = {};
  int64_t j = j0;
  for (; j + K <= j1; j += K) {
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) {
      const A e = f(j + k);
      a1[k] += e;
      a2[k] += e * e;
    }
  }
  A s1 = 0, s2 = 0;
  for (; j < j1; ++j) {
    const A e = f(j);
    s1 += e;
    s2 += e * e;
  }
  return {fold_lanes<K>(s1, a1), fold_lanes<K>(s2, a2)};
}

template <int64_t K, typename A, typename F>
inline void lane_sum2_k(int64_t n, F f, A& s1, A& s2) {
  if (n <= kSumBlock) {
    const auto s = lane_sum2_range<K, A>(0, n, f);
    s1 = s[0];
    s2 = s[1];
    return;
  }
  double s[2];
  over_blocks<2>(n, [&](int64_t jb, int64_t je) { return lane_sum2_range<K, A>(jb, je, f); }, s);
  s1 = static_cast<A>(s[0]);
  s2 = static_cast<A>(s[1]);
}

template <typename A, typename F>
inline void lane_sum2(int64_t n, F f, A& s1, A& s2) {
  with_lanes(n, [&](auto k) { lane_sum2_k<decltype(k)::value, A>(n, f, s1, s2); });
}

// Mean and sum of squared deviations of a row (LayerNorm) by the corrected two-pass algorithm (Chan, Golub &
// LeVeque 1983), as the vector kernels compute them: a sum for the mean (`first(j)`, which may also write h), then
// sum (v - mean) and sum (v - mean)^2 over the now cached row (`again(j)`), the first correcting the rounding of
// the mean. As accurate as Welford's update without its division per element (which made short rows slow).
template <typename A, typename F1, typename F2>
inline void row_moments(int64_t n, F1 first, F2 again, A& mean, A& m2) {
  const A mu = lane_sum<A>(n, first) / static_cast<A>(n);
  A sd, sq;
  lane_sum2<A>(n, [&](int64_t j) { return again(j) - mu; }, sd, sq);
  mean = mu + sd / static_cast<A>(n);
  m2 = std::max(A(0), sq - sd * sd / static_cast<A>(n));
}

// Whether an input of this many bytes streams from memory rather than from the last-level cache: a fixed
// 8 MiB, a quarter of a 32 MiB L3 (sysconf's cache sizes are unreliable in VMs: one here reports 320 MiB).
inline bool streams_from_memory(int64_t bytes) { return bytes > (int64_t(8) << 20); }

// Whether an output streamed from memory may be written with non-temporal stores: only when its pages are
// already mapped (a reused heap block). A fresh mapping faults on first touch and the kernel zeroes each page
// through the cache, so plain stores then hit cache, while streaming stores must first evict the zeroed lines:
// measured at 2048 x 4096 fp32, streaming stores save ~30% on reused pages and cost ~6% on fresh ones.
// mincore() on the first and last page tells which case this is (Linux; elsewhere: plain stores).
inline bool pages_mapped(const void* p, int64_t bytes) {
#if defined(__linux__)
  if (bytes <= 0) return false;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char v = 0;
  for (uintptr_t a : {reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + bytes - 1}) {
    if (mincore(reinterpret_cast<void*>(a & ~(page - 1)), 1, &v) != 0 || !(v & 1)) return false;
  }
  return true;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// Whether an output of `bytes` at p, rows of `row_bytes`, streamed from memory, may be written with streaming stores:
// its pages already mapped (pages_mapped), and every row starting and ending on a 64-byte line, so that no line is
// written partly by streaming stores and partly by plain ones (one row's last line and the next row's first): mixed
// in a line, rows of 8-48 bf16 features from memory took 15-89x a copy's time, and the fp32 backward of 8 or 24
// features 20-50x.
inline bool streaming_stores(const void* p, int64_t row_bytes, int64_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & 63u) == 0 && row_bytes % 64 == 0 && pages_mapped(p, bytes);
}

// Runs body(jb, je) over blocks of L elements, first prefetching the same span of p1 and p2 (either may be
// null): a pass that works on a cached row can pull the next row in from memory meanwhile.
template <typename R, typename F>
inline void blocked(int64_t n, const R* p1, const R* p2, F&& body) {
  for (int64_t j0 = 0; j0 < n; j0 += L) {
    const int64_t je = std::min(n, j0 + L);
    const int64_t bytes = (je - j0) * static_cast<int64_t>(sizeof(R));
    for (int64_t o = 0; p1 && o < bytes; o += 64) __builtin_prefetch(reinterpret_cast<const char*>(p1 + j0) + o, 0, 3);
    for (int64_t o = 0; p2 && o < bytes; o += 64) __builtin_prefetch(reinterpret_cast<const char*>(p2 + j0) + o, 0, 3);
    body(j0, je);
  }
}

// Runs f(begin, end) over [0, rows) on the intra-op thread pool, or in the calling thread when `parallel` is false
// (a caller that is already inside its own parallel region over a larger problem).
template <typename F>
inline void over_rows(bool parallel, int64_t rows, int64_t grain, const F& f) {
  if (parallel) at::parallel_for(0, rows, grain, f);
  else f(0, rows);
}

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

}  // namespace normatlas::rows
