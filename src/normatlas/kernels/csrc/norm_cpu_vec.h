// Explicit-vector row kernels for fp32, bf16 and fp16 (included by norm_kernels.cpp when the compiler targets
// AVX-512 (F, BW, VL) or AVX2 with FMA and F16C).
//
// Written with 256-bit vectors (8 fp32 lanes). With AVX-512VL the row tails use its masked loads / stores and the
// bf16 stores its VCVTNEPS2BF16 (AVX512_BF16); with AVX2 the same code runs with AVX2's masked fp32 loads / stores
// and a small buffer for 16-bit tails (the mask helpers below), so CPUs without AVX-512 get the same arithmetic,
// bit for bit, rather than the compiler-vectorised templates (whose fp16 conversions do not vectorise: fp16
// LayerNorm ran at 0.23-0.42x torch's there). A memory-bound kernel moves the same bytes per cycle at 256 or 512
// bits, and 256 bits runs at full rate on cores that split or down-clock 512-bit work. Measured against the same
// code at 512 bits (interleaved in one process, 2048 x 4096 fp32 forward): level on reused output pages (1.79 vs
// 1.85 ms with 2 threads, 3.21 vs 2.91 with 1), 4-6% faster on freshly mapped ones (14.3 vs 14.8 ms, 22.1 vs 23.5).
// The exception is the half-precision output pass (write_row_512, AVX-512 only): bound by its conversions, not by
// memory, it runs at 512 bits.
//
// The same arithmetic as the generic templates in norm_kernels.cpp, written with explicit vectors:
// compilers vectorise the generic bf16 loops poorly (a scalar round-to-nearest-even with a NaN test per
// element, an array of lane sums), which left the bf16 forward at 6x a copy on a cache-resident input.
// Conversions: bf16 -> fp32 is a 16-bit shift; fp32 -> bf16 rounds to nearest even (one VCVTNEPS2BF16 with
// AVX512_BF16, else the same integer rounding as the scalar path, NaN kept quiet); fp16 uses F16C
// VCVTPH2PS / VCVTPS2PH with round to nearest even. Statistics are fp32. Tails are masked, so any row
// length runs on the vector path.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NORMATLAS_VEC512 1
#else
#define NORMATLAS_VEC512 0
#endif

// The row functions inline everything they call (the loads, stores, conversions, masks and the lambdas built on them):
// left to GCC's unit-wide inlining budget, the choice changed with the size of the translation unit, and when the
// backward's tiles were added it stopped inlining `input_at` and spilled `moments`' accumulators, which made the
// bf16 LayerNorm forward 1.25-1.31x slower (old and new builds interleaved in one process) with no change to its code.
#define NORMATLAS_ROW __attribute__((flatten))

// Where the next row goes while this one is written (inputs streaming from memory): L2, not L1, which the row being
// written and the gain already fill. Against L1 (T0), builds interleaved in one process with reused buffers at
// 2048 x 4096 and 8192 x 1024: the bf16 backward took 0.78-0.95x the time, the fp32 one 0.94-1.00x, the add + norm
// forward 0.94-1.01x, the forward 0.97-1.02x.
#define NORMATLAS_NEXT_ROW _MM_HINT_T1

namespace vec {

// A row tail's lanes: always a prefix (the low `left` bits), 0xff for a whole vector.
using mask8 = uint8_t;
inline mask8 tail_mask(int64_t left) { return static_cast<mask8>((1u << left) - 1u); }

#if NORMATLAS_VEC512
inline __m256 maskz_load_ps(mask8 m, const float* p) { return _mm256_maskz_loadu_ps(m, p); }
inline void mask_store_ps(float* p, mask8 m, __m256 v) { _mm256_mask_storeu_ps(p, m, v); }
inline __m128i maskz_load_epi16(mask8 m, const uint16_t* p) { return _mm_maskz_loadu_epi16(m, p); }
inline void mask_store_epi16(uint16_t* p, mask8 m, __m128i v) { _mm_mask_storeu_epi16(p, m, v); }
inline __m256 maskz_sub_ps(mask8 m, __m256 a, __m256 b) { return _mm256_maskz_sub_ps(m, a, b); }
#else
// AVX2: the fp32 lanes below the tail's length as an all-ones vector mask (VMASKMOVPS, masked lanes never touched);
// 16-bit tails go through an 8-element buffer.
inline __m256i lanes(mask8 m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(__builtin_popcount(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 maskz_load_ps(mask8 m, const float* p) { return _mm256_maskload_ps(p, lanes(m)); }
inline void mask_store_ps(float* p, mask8 m, __m256 v) { _mm256_maskstore_ps(p, lanes(m), v); }
inline __m128i maskz_load_epi16(mask8 m, const uint16_t* p) {
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, sizeof(uint16_t) * __builtin_popcount(m));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}
inline void mask_store_epi16(uint16_t* p, mask8 m, __m128i v) {
  alignas(16) uint16_t buf[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), v);
  std::memcpy(p, buf, sizeof(uint16_t) * __builtin_popcount(m));
}
inline __m256 maskz_sub_ps(mask8 m, __m256 a, __m256 b) {
  return _mm256_and_ps(_mm256_sub_ps(a, b), _mm256_castsi256_ps(lanes(m)));
}
#endif

// Whether streaming (non-temporal) stores may write a row starting at p: it must start on a 64-byte line.
inline bool line_aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63u) == 0; }

// The sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// hsum of eight vectors at once: lane r of the result is hsum(v[r]), added in the same order (bit for bit), for the
// row groups of short rows (row_stats8). hsum adds t_k = v[k] + v[k + 4], then (t_0 + t_2) + (t_1 + t_3).
inline __m256 hsum8(const __m256* v) {
  __m256 t[4];  // t[i]: t_0..3 of v[2i] in the low half, of v[2i + 1] in the high half
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  }
  // p = t_0 + t_2 and q = t_1 + t_3: low half [p, q of v0; p, q of v2], high half the same of v1, v3 (and v4..v7)
  const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 d = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // p + q: lanes in the order v0, v2, v4, v6, v1, v3, v5, v7, put back in row order
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(c, d, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Wide rows: the statistics of a row over kWideRow elements sum it in blocks of kSumBlock, each block in fp32 lanes
// as a short row is (32 lanes: 8 adds a lane), each block's lanes folded into fp64 lanes (`Wide`), and the row's
// mean, rstd and d rstd / d ms computed in fp64 from those sums and rounded once. Summed in fp32 lanes from start to
// end, each lane of a row of n added n / 32 values one after another, and the error grew with n: one fp32 row of
// 4,194,304 values came out 5.1e-5 from float64 (torch 4.5e-7), one of 16,777,216 values offset by 3 4.6e-4 in
// LayerNorm (torch 7.8e-7), and with one massive channel (3e3 among N(0, 1) values) each later add into its lane lost
// up to half a unit of 9e6 (rstd 5.2e-4 from float64 at 2^24, torch 4.8e-8). Blocked, a row of any width errs about
// as a row of one block does (docs/kernels.md, "Wide rows"). Blocks of 1024 left the massive channel's lane 32 adds
// a block, and LayerNorm's output 3.6x torch's error at 2^22; blocks of 256 took it under 2x. Rows up to kWideRow
// keep the fp32 sums and scale of before, bit for bit: every row whose statistics are taken 8 at a time (up to
// 2 KiB) is one of them.
constexpr int64_t kSumBlock = 256, kWideRow = 1024;

struct Wide {  // 8 fp64 lanes: the fp32 lanes of 8 columns, block after block
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  inline void add(__m256 v) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  inline double sum() const {
    const __m256d t = _mm256_add_pd(lo, hi);
    const __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
  }
};

struct F32 {
  using raw = float;
  static constexpr bool kWide = false;  // memory-bound at either width: stays at 256 bits
  static inline __m256 ld(const raw* p) { return _mm256_loadu_ps(p); }
  static inline __m256 ldm(const raw* p, mask8 m) { return maskz_load_ps(m, p); }
  static inline void st(raw* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static inline void stm(raw* p, __m256 v, mask8 m) { mask_store_ps(p, m, v); }
  static inline __m256 rt(__m256 v) { return v; }  // round trip through the storage dtype
  static inline __m256 st_rt(raw* p, __m256 v) {  // store v, return it as stored (one rounding, not two)
    st(p, v);
    return v;
  }
  // 16 elements at once (two vectors): lo = elements 0-7, hi = 8-15
  static inline void ld2(const raw* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  }
  static inline void st2(raw* p, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
#if NORMATLAS_VEC512
  static inline __m512 ld16(const raw* p) { return _mm512_loadu_ps(p); }  // 16 elements as one 512-bit vector
#endif
  // non-temporal (streaming) stores, p 64-byte aligned: the line goes to memory without being read first
  static inline void st_nt(raw* p, __m256 v) { _mm256_stream_ps(p, v); }
  static inline void st2_nt(raw* p, __m256 lo, __m256 hi) {
    _mm256_stream_ps(p, lo);
    _mm256_stream_ps(p + 8, hi);
  }
};

struct BF16 {
  using raw = uint16_t;
  static inline __m256 up(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static inline __m128i down(__m256 v) {
#if defined(__AVX512BF16__)
    return (__m128i)_mm256_cvtneps_pbh(v);
#else
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
#if NORMATLAS_VEC512
    const __mmask8 nan = _mm256_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm256_mask_or_epi32(r, nan, _mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_cvtepi32_epi16(r);
#else
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // eight 32-bit lanes (each < 2^16) to eight 16-bit ones, in order: pack per 128-bit lane, then gather
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
#endif
#endif
  }
  static inline __m256 ld(const raw* p) { return up(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline __m256 ldm(const raw* p, mask8 m) { return up(maskz_load_epi16(m, p)); }
  static inline void st(raw* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), down(v)); }
  static inline void stm(raw* p, __m256 v, mask8 m) { mask_store_epi16(p, m, down(v)); }
  static inline __m256 rt(__m256 v) { return up(down(v)); }
  static inline __m256 st_rt(raw* p, __m256 v) {
    const __m128i h = down(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return up(h);
  }
#if NORMATLAS_VEC512
  static inline __m512 ld16(const raw* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  static inline void ld2(const raw* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = up(_mm256_castsi256_si128(v));
    hi = up(_mm256_extracti128_si256(v, 1));
  }
  static inline void st2(raw* p, __m256 lo, __m256 hi) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack2(lo, hi));
  }
  static inline __m256i pack2(__m256 lo, __m256 hi) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm256_cvtne2ps_pbh(hi, lo);
#else
    return _mm256_inserti128_si256(_mm256_castsi128_si256(down(lo)), down(hi), 1);
#endif
  }
  static inline void st_nt(raw* p, __m256 v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), down(v)); }
  static inline void st2_nt(raw* p, __m256 lo, __m256 hi) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack2(lo, hi));
  }
  // 16 elements in the backward's lane order (lane_order below): lo = elements 0-3 and 8-11, hi = 4-7 and 12-15, one
  // unpack with zeros each, where widening in order takes a zero-extension and a shift per 8 (ld2); st2p stores them
  // back in order (one permutation after the pack).
  static inline void ld2p(const raw* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
  }
  static inline void st2p(raw* p, __m256 lo, __m256 hi) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(pack2(lo, hi), 0xD8));
  }
#if defined(__AVX512BF16__) && NORMATLAS_VEC512
  // 512-bit forms for write_row_512: 16 elements up to fp32, 2 x 16 packed back, a round trip
  static constexpr bool kWide = true;
  static inline __m512 up16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static inline __m512i pack16x2(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
  static inline __m512 rt16(__m512 v) { return up16((__m256i)_mm512_cvtneps_pbh(v)); }
#else
  static constexpr bool kWide = false;
#endif
};

struct F16 {
  using raw = uint16_t;
  static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  static inline __m256 ld(const raw* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline __m256 ldm(const raw* p, mask8 m) { return _mm256_cvtph_ps(maskz_load_epi16(m, p)); }
  static inline void st(raw* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRound));
  }
  static inline void stm(raw* p, __m256 v, mask8 m) { mask_store_epi16(p, m, _mm256_cvtps_ph(v, kRound)); }
  static inline __m256 rt(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, kRound)); }
  static inline __m256 st_rt(raw* p, __m256 v) {
    const __m128i h = _mm256_cvtps_ph(v, kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return _mm256_cvtph_ps(h);
  }
  static inline void ld2(const raw* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
  }
  static inline __m256i pack2(__m256 lo, __m256 hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(lo, kRound)), _mm256_cvtps_ph(hi, kRound), 1);
  }
  static inline void st2(raw* p, __m256 lo, __m256 hi) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack2(lo, hi));
  }
  static inline void st_nt(raw* p, __m256 v) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRound));
  }
  static inline void st2_nt(raw* p, __m256 lo, __m256 hi) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack2(lo, hi));
  }
#if NORMATLAS_VEC512
  static constexpr bool kWide = true;  // VCVTPH2PS / VCVTPS2PH at 512 bits are AVX512F
  static inline __m512 ld16(const raw* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline __m512 up16(__m256i h) { return _mm512_cvtph_ps(h); }
  static inline __m512i pack16x2(__m512 lo, __m512 hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(lo, kRound)), _mm512_cvtps_ph(hi, kRound), 1);
  }
  static inline __m512 rt16(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, kRound)); }
#else
  static constexpr bool kWide = false;
#endif
};

// The parameter type of a normalization without gain or bias (LayerNorm / RMSNorm with no affine, as DiT's adaLN
// and weightless QK-norm use): every "load" is a constant 1, so no gain row streams through L1 beside the input
// and the output (at 256 x 4096 fp32 that stream alone costs ~0.4x a copy's time: a C++ harness ran y = x * s * g at
// 124 us and y = x * s at 87 us, a copy at 86). The multiplications by it are exact.
struct NoGain {
  using raw = float;
  static inline __m256 ld(const raw*) { return _mm256_set1_ps(1.f); }
  static inline __m256 ldm(const raw*, mask8) { return _mm256_set1_ps(1.f); }
#if NORMATLAS_VEC512
  static inline __m512 ld16(const raw*) { return _mm512_set1_ps(1.f); }
#endif
};

// Calls body(j, mask) over the row in 8-lane steps, the last one masked (mask 0xff elsewhere).
template <typename F>
inline void each8(int64_t n, F&& body) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) body(j, static_cast<mask8>(0xff));
  if (j < n) body(j, tail_mask(n - j));
}

template <class V>
inline __m256 load(const typename V::raw* p, mask8 m) {
  return m == 0xff ? V::ld(p) : V::ldm(p, m);
}
template <class V>
inline void store(typename V::raw* p, __m256 v, mask8 m) {
  if (m == 0xff) V::st(p, v);
  else V::stm(p, v, m);
}
inline __m256 loadf(const float* p, mask8 m) { return m == 0xff ? _mm256_loadu_ps(p) : maskz_load_ps(m, p); }
// A whole vector by a plain store: AVX2's VMASKMOVPS store is slow even with every lane set. Storing the gain / bias
// partial sums through it, the AVX2 backward from memory (2048 x 4096, 8192 x 1024, fp32 / bf16, RMSNorm / LayerNorm)
// took 1.26-2.60x the time it takes with plain stores (builds interleaved in one process, 2 threads, Zen 4).
inline void storef(float* p, mask8 m, __m256 v) {
  if (m == 0xff) _mm256_storeu_ps(p, v);
  else mask_store_ps(p, m, v);
}

// The statistics pass's input at j: x, or with a residual h = x + r rounded to the storage dtype, written out to h
// (the updated residual stream) and returned as rounded. A whole vector is rounded once for both (st_rt): rounding
// for the sum and again for the store, the bf16 add + norm took 1.09-1.15x the time at 256 x 4096, 4096 x 256 and
// 1024 x 1024 (1.02x at 2048 x 4096; builds interleaved in one process, 2 threads).
template <class V>
inline __m256 input_at(const typename V::raw* x, const typename V::raw* r, typename V::raw* h, int64_t j, mask8 m) {
  if (!r) return load<V>(x + j, m);
  const __m256 s = _mm256_add_ps(load<V>(x + j, m), load<V>(r + j, m));
  if (m == 0xff) return V::st_rt(h + j, s);  // rounded once, stored and returned
  const __m256 v = V::rt(s);
  store<V>(h + j, v, m);
  return v;
}

// 16 bf16 elements as fp32, de-interleaved: `even` holds elements 0, 2, .., 14, `odd` 1, 3, .., 15 (a shift and a
// mask, no cross-lane widening): for sums, whose order within a row is free. Builds without AVX512_BF16 sum bf16
// squares this way too (the RMSNorm forward there: 0.97-0.99x the time of widening in order).
inline void split16(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Sum of squares of a row with four independent accumulators (so the FMAs pipeline), as the 8 lanes left for the
// final horizontal sum (row_stats8). With a residual, h = x + r rounded to the storage dtype is written out and its
// rounded value is what is summed.
template <class V> NORMATLAS_ROW
inline __m256 sumsq_v(const typename V::raw* x, const typename V::raw* r, typename V::raw* h, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  auto val = [&](int64_t j, mask8 m) { return input_at<V>(x, r, h, j, m); };
  int64_t j = 0;
#if defined(__AVX512BF16__)
  if (std::is_same_v<V, BF16> && !r) {
    // bf16 pairs straight into fp32 sums: VDPBF16PS forms each square exactly and adds it in fp32
    // (denormal bf16 inputs, below 1e-38, count as zero), 16 elements per instruction, four independent sums
    for (; j + 64 <= n; j += 64) {
      const __m256bh v0 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
      const __m256bh v1 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j + 16));
      const __m256bh v2 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j + 32));
      const __m256bh v3 = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j + 48));
      a0 = _mm256_dpbf16_ps(a0, v0, v0);
      a1 = _mm256_dpbf16_ps(a1, v1, v1);
      a2 = _mm256_dpbf16_ps(a2, v2, v2);
      a3 = _mm256_dpbf16_ps(a3, v3, v3);
    }
  }
#endif
  if (std::is_same_v<V, BF16> && !r) {
    for (; j + 32 <= n; j += 32) {
      __m256 e0, o0, e1, o1;
      split16(reinterpret_cast<const uint16_t*>(x + j), e0, o0);
      split16(reinterpret_cast<const uint16_t*>(x + j + 16), e1, o1);
      a0 = _mm256_fmadd_ps(e0, e0, a0);
      a1 = _mm256_fmadd_ps(o0, o0, a1);
      a2 = _mm256_fmadd_ps(e1, e1, a2);
      a3 = _mm256_fmadd_ps(o1, o1, a3);
    }
  }
  for (; j + 32 <= n; j += 32) {
    const __m256 v0 = val(j, 0xff), v1 = val(j + 8, 0xff), v2 = val(j + 16, 0xff), v3 = val(j + 24, 0xff);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2);
    a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  for (; j < n; j += 8) {
    const mask8 m = j + 8 <= n ? static_cast<mask8>(0xff) : tail_mask(n - j);
    const __m256 v = val(j, m);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

// Mean and sum of squared deviations by the corrected two-pass algorithm (Chan, Golub & LeVeque 1983): a sum
// for the mean, then sum (v - mean)^2 and sum (v - mean) over the now cached row, the second sum correcting the
// rounding of the first mean. As accurate as Welford's update and cheaper (no division chain): the second pass
// reads L1, and a massive activation in one channel does not cancel digits as a one-pass sum of squares does.
// bf16 rows are summed de-interleaved (split16): the bf16 LayerNorm forward took 0.86-0.94x the time of widening
// each element in order (256 x 4096, 2048 x 4096, 4096 x 256; builds interleaved in one process, 2 threads).
// In two stages, as lanes for row_stats8's horizontal sums: moments_sum (the first pass, h written) and moments_dev
// (the deviation pass about the first mean).
template <class V> NORMATLAS_ROW
inline __m256 moments_sum(const typename V::raw* x, const typename V::raw* r, typename V::raw* h, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  auto val = [&](int64_t j, mask8 m) { return input_at<V>(x, r, h, j, m); };
  int64_t j = 0;
  if (r) {
    for (; j + 32 <= n; j += 32) {
      a0 = _mm256_add_ps(a0, val(j, 0xff));
      a1 = _mm256_add_ps(a1, val(j + 8, 0xff));
      a2 = _mm256_add_ps(a2, val(j + 16, 0xff));
      a3 = _mm256_add_ps(a3, val(j + 24, 0xff));
    }
  } else if constexpr (std::is_same_v<V, BF16>) {
    for (; j + 32 <= n; j += 32) {
      __m256 e0, o0, e1, o1;
      split16(x + j, e0, o0);
      split16(x + j + 16, e1, o1);
      a0 = _mm256_add_ps(a0, e0);
      a1 = _mm256_add_ps(a1, o0);
      a2 = _mm256_add_ps(a2, e1);
      a3 = _mm256_add_ps(a3, o1);
    }
  } else {  // the common case without a residual, kept free of the residual's branch
    for (; j + 32 <= n; j += 32) {
      a0 = _mm256_add_ps(a0, V::ld(x + j));
      a1 = _mm256_add_ps(a1, V::ld(x + j + 8));
      a2 = _mm256_add_ps(a2, V::ld(x + j + 16));
      a3 = _mm256_add_ps(a3, V::ld(x + j + 24));
    }
  }
  for (; j < n; j += 8) a0 = _mm256_add_ps(a0, val(j, j + 8 <= n ? static_cast<mask8>(0xff) : tail_mask(n - j)));
  return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

template <class V> NORMATLAS_ROW
inline void moments_dev(const typename V::raw* src, int64_t n, float mu0, __m256& sq_v, __m256& sd_v) {
  const __m256 mu = _mm256_set1_ps(mu0);
  // four independent chains each for the squares and the deviations, so the FMA latency stays hidden
  __m256 q[4], d[4];
  for (int k = 0; k < 4; ++k) q[k] = d[k] = _mm256_setzero_ps();
  int64_t j = 0;
  if constexpr (std::is_same_v<V, BF16>) {
    for (; j + 32 <= n; j += 32) {
      __m256 v[4];
      split16(src + j, v[0], v[1]);
      split16(src + j + 16, v[2], v[3]);
      for (int k = 0; k < 4; ++k) {
        const __m256 e = _mm256_sub_ps(v[k], mu);
        q[k] = _mm256_fmadd_ps(e, e, q[k]);
        d[k] = _mm256_add_ps(d[k], e);
      }
    }
  }
  for (; j + 32 <= n; j += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256 e = _mm256_sub_ps(V::ld(src + j + 8 * k), mu);
      q[k] = _mm256_fmadd_ps(e, e, q[k]);
      d[k] = _mm256_add_ps(d[k], e);
    }
  }
  for (; j < n; j += 8) {
    const mask8 m = j + 8 <= n ? static_cast<mask8>(0xff) : tail_mask(n - j);
    const __m256 e = maskz_sub_ps(m, load<V>(src + j, m), mu);  // masked lanes stay 0
    q[0] = _mm256_fmadd_ps(e, e, q[0]);
    d[0] = _mm256_add_ps(d[0], e);
  }
  const __m256 q0 = _mm256_add_ps(q[0], q[1]), q1 = _mm256_add_ps(q[2], q[3]);
  const __m256 d0 = _mm256_add_ps(d[0], d[1]), d1 = _mm256_add_ps(d[2], d[3]);
  sd_v = _mm256_add_ps(d0, d1);
  sq_v = _mm256_add_ps(q0, q1);
}

// The sums of one row wider than kWideRow, a block at a time into fp64 (Wide): of the squares (wide_sum over
// sumsq_v), of the values (over moments_sum; h written), and of the deviations about mu0 and their squares
// (moments_dev). `Lanes` is a template argument, so each instance calls it directly and flatten inlines it.
template <class V>
using LanesFn = __m256 (*)(const typename V::raw*, const typename V::raw*, typename V::raw*, int64_t);

template <class V, LanesFn<V> Lanes> NORMATLAS_ROW
inline double wide_sum(const typename V::raw* x, const typename V::raw* r, typename V::raw* h, int64_t n) {
  Wide w;
  for (int64_t j = 0; j < n; j += kSumBlock) {
    w.add(Lanes(x + j, r ? r + j : nullptr, r ? h + j : nullptr, std::min(kSumBlock, n - j)));
  }
  return w.sum();
}

template <class V> NORMATLAS_ROW
inline void moments_dev_wide(const typename V::raw* src, int64_t n, float mu0, double& sq, double& sd) {
  Wide wq, wd;
  for (int64_t j = 0; j < n; j += kSumBlock) {
    __m256 q, d;
    moments_dev<V>(src + j, std::min(kSumBlock, n - j), mu0, q, d);
    wq.add(q);
    wd.add(d);
  }
  sq = wq.sum();
  sd = wd.sum();
}

// The statistics of `rows` (1 to 8) consecutive rows, written as (mean, rstd, d rstd / d ms) to st[3 i ..]: each
// row's lanes (moments_sum / moments_dev, sumsq_v), the horizontal sums of up to eight rows in one hsum8 and the
// scale (rows::scale_of's arithmetic) in vector registers. Short rows come 8 at a time (write_group), so that the adds
// of one row no longer wait on the previous row's horizontal sums, square root and division; long rows one at a time.
template <class V> NORMATLAS_ROW
inline void row_stats8(const typename V::raw* x, const typename V::raw* r, typename V::raw* h, int64_t n,
                       int64_t rows, bool center, float eps, float div, int64_t eps_mode, float* st) {
  __m256 a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = b[i] = _mm256_setzero_ps();
  const __m256 nf = _mm256_set1_ps(static_cast<float>(n));
  __m256 mean = _mm256_setzero_ps(), ss;
  if (n > kWideRow) {  // one wide row (groups are of narrower rows): its sums and scale in fp64, each rounded once
    const double nd = static_cast<double>(n);
    double mu = 0, ss_d;
    if (center) {
      const float mu0 = static_cast<float>(wide_sum<V, moments_sum<V>>(x, r, h, n) / nd);
      double sq, sd;
      moments_dev_wide<V>(r ? h : x, n, mu0, sq, sd);
      mu = mu0 + sd / nd;
      ss_d = std::max(0.0, sq - sd * sd / nd);
    } else {
      ss_d = wide_sum<V, sumsq_v<V>>(x, r, h, n);
    }
    double rs_d, dr_d;
    normatlas::rows::scale_of<double>(ss_d / static_cast<double>(div), static_cast<double>(eps), eps_mode, rs_d, dr_d);
    st[0] = static_cast<float>(mu);
    st[1] = static_cast<float>(rs_d);
    st[2] = static_cast<float>(dr_d);
    return;
  } else if (center) {
    for (int64_t i = 0; i < rows; ++i) {
      a[i] = moments_sum<V>(x + i * n, r ? r + i * n : nullptr, r ? h + i * n : nullptr, n);
    }
    alignas(32) float mu0[8];
    const __m256 mu = _mm256_div_ps(hsum8(a), nf);
    _mm256_store_ps(mu0, mu);
    for (int64_t i = 0; i < rows; ++i) moments_dev<V>((r ? h : x) + i * n, n, mu0[i], a[i], b[i]);
    const __m256 sq = hsum8(a), sd = hsum8(b);
    mean = _mm256_add_ps(mu, _mm256_div_ps(sd, nf));
    ss = _mm256_max_ps(_mm256_sub_ps(sq, _mm256_div_ps(_mm256_mul_ps(sd, sd), nf)), _mm256_setzero_ps());
  } else {
    for (int64_t i = 0; i < rows; ++i) {
      a[i] = sumsq_v<V>(x + i * n, r ? r + i * n : nullptr, r ? h + i * n : nullptr, n);
    }
    ss = hsum8(a);
  }
  const __m256 ms = _mm256_div_ps(ss, _mm256_set1_ps(div)), e = _mm256_set1_ps(eps), one = _mm256_set1_ps(1.f);
  const __m256 half = _mm256_set1_ps(-0.5f), zero = _mm256_setzero_ps();
  __m256 rs, dr;
  if (eps_mode == normatlas::INSIDE) {
    rs = _mm256_div_ps(one, _mm256_sqrt_ps(_mm256_add_ps(ms, e)));
    dr = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, rs), rs), rs);
  } else {
    const __m256 s = _mm256_sqrt_ps(ms);
    const __m256 pos = _mm256_cmp_ps(s, zero, _CMP_GT_OQ);
    if (eps_mode == normatlas::OUTSIDE) {
      rs = _mm256_div_ps(one, _mm256_add_ps(s, e));
      dr = _mm256_and_ps(pos, _mm256_div_ps(_mm256_mul_ps(_mm256_mul_ps(half, rs), rs), s));
    } else {  // a clamp: 1 / (s > eps ? s : eps), which is what MAXPS computes (NaN s included)
      rs = _mm256_div_ps(one, _mm256_max_ps(s, e));
      const __m256 live = _mm256_and_ps(_mm256_cmp_ps(s, e, _CMP_GE_OQ), pos);
      dr = _mm256_and_ps(live, _mm256_div_ps(half, _mm256_mul_ps(_mm256_mul_ps(s, s), s)));
    }
  }
  alignas(32) float m8[8], r8[8], d8[8];
  _mm256_store_ps(m8, mean);
  _mm256_store_ps(r8, rs);
  _mm256_store_ps(d8, dr);
  for (int64_t i = 0; i < rows; ++i) {
    st[3 * i] = m8[i];
    st[3 * i + 1] = r8[i];
    st[3 * i + 2] = d8[i];
  }
}

#if NORMATLAS_VEC512
// write_row's half-precision body in 512-bit registers (V::kWide: fp16, and bf16 with AVX512_BF16), 32 elements
// (one 64-byte line) a step; returns where it stopped (the caller's 256-bit loops finish the row). The half-precision
// output pass is bound by its conversions rather than by memory, and 512-bit forms do twice the elements per
// instruction: old and new builds interleaved in one process (three runs for bf16, one for fp16), the forward took
// 0.80-0.92x (RMSNorm) and 0.79-0.94x (LayerNorm) the time in bf16 at 256 x 4096, 0.92-0.98x / 0.77-0.90x at
// 2048 x 4096, and 0.84-0.88x in fp16. Same arithmetic and roundings as the 256-bit loop: bit-identical outputs.
template <class V, class P, bool C, bool BG, bool B> NORMATLAS_ROW
inline int64_t write_row_512(const uint16_t* src, uint16_t* y, const typename P::raw* g, const typename P::raw* b,
                             float mean, float rstd, int64_t n, const uint16_t* nx, const uint16_t* nr, bool nt) {
  const __m512 mu = _mm512_set1_ps(mean), rs = _mm512_set1_ps(rstd);
  const auto affine = [&](__m512 v, int64_t j) {
    if (C) v = _mm512_sub_ps(v, mu);
    v = _mm512_mul_ps(v, rs);
    const __m512 gv = P::ld16(g + j);
    if (BG) {  // without a bias the store rounds the product (rounding it here too would change nothing)
      v = _mm512_mul_ps(V::rt16(v), gv);
      return B ? _mm512_add_ps(V::rt16(v), P::ld16(b + j)) : v;
    }
    return B ? _mm512_fmadd_ps(v, gv, P::ld16(b + j)) : _mm512_mul_ps(v, gv);
  };
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    if (nx) {  // the next row streams in from memory while this one is written from cache
      _mm_prefetch(reinterpret_cast<const char*>(nx + j), NORMATLAS_NEXT_ROW);
      if (nr) _mm_prefetch(reinterpret_cast<const char*>(nr + j), NORMATLAS_NEXT_ROW);
    }
    const __m512i v = _mm512_loadu_si512(src + j);
    const __m512 lo = affine(V::up16(_mm512_castsi512_si256(v)), j);
    const __m512 hi = affine(V::up16(_mm512_extracti64x4_epi64(v, 1)), j + 16);
    const __m512i out = V::pack16x2(lo, hi);
    if (nt) _mm512_stream_si512(reinterpret_cast<__m512i*>(y + j), out);  // y line-aligned, j whole lines
    else _mm512_storeu_si512(y + j, out);
  }
  return j;
}

#endif

// y = affine(normalised row), reading the row (x, or h with a residual) from cache. P: the dtype gain and bias are
// read in (F32, or V itself: a bf16 model's own gain, no converted copy, half the bytes); C: subtract the mean;
// BG: cast before the gain (HF Llama order: gain * x_hat.to(dtype), each product rounded); B: add a bias.
// With `nx` / `nr` set (inputs streaming from memory) the next row is prefetched while this one is written.
template <class V, class P, bool C, bool BG, bool B> NORMATLAS_ROW
inline void write_row(const typename V::raw* src, typename V::raw* y, const typename P::raw* g,
                      const typename P::raw* b, float mean, float rstd, int64_t n, const typename V::raw* nx,
                      const typename V::raw* nr, bool nt) {
  const __m256 mu = _mm256_set1_ps(mean), rs = _mm256_set1_ps(rstd);
  nt = nt && line_aligned(y);
  auto affine = [&](__m256 v, int64_t j, mask8 m) {
    if (C) v = _mm256_sub_ps(v, mu);
    v = _mm256_mul_ps(v, rs);
    const __m256 gv = load<P>(g + j, m);
    if (BG) {  // without a bias the store rounds the product (rounding it here too would change nothing)
      v = _mm256_mul_ps(V::rt(v), gv);
      return B ? _mm256_add_ps(V::rt(v), load<P>(b + j, m)) : v;
    }
    return B ? _mm256_fmadd_ps(v, gv, load<P>(b + j, m)) : _mm256_mul_ps(v, gv);
  };
  constexpr int64_t kLine = 64 / sizeof(typename V::raw);  // elements per 64-byte line
  int64_t j = 0;
#if NORMATLAS_VEC512
  if constexpr (V::kWide) j = write_row_512<V, P, C, BG, B>(src, y, g, b, mean, rstd, n, nx, nr, nt);
#endif
  for (; j + 16 <= n; j += 16) {  // 16 elements: one line of fp32, half a line of bf16 / fp16
    if (nx && j % kLine == 0) {  // the next row streams in from memory while this one is written from cache
      _mm_prefetch(reinterpret_cast<const char*>(nx + j), NORMATLAS_NEXT_ROW);
      if (nr) _mm_prefetch(reinterpret_cast<const char*>(nr + j), NORMATLAS_NEXT_ROW);
    }
    __m256 lo, hi;
    V::ld2(src + j, lo, hi);
    if (nt) V::st2_nt(y + j, affine(lo, j, 0xff), affine(hi, j + 8, 0xff));
    else V::st2(y + j, affine(lo, j, 0xff), affine(hi, j + 8, 0xff));
  }
  each8(n - j, [&](int64_t k, mask8 m) { store<V>(y + j + k, affine(load<V>(src + j + k, m), j + k, m), m); });
}

// A group of at most 8 short rows, start to end: their statistics (row_stats8, into st) and then their outputs, in
// one call (the per-row call of write_row, its setup and its argument passing cost as much as a 16-wide row). With
// `ahead` rows after the group (inputs streaming from memory), writing row i prefetches row i + 8.
template <class V, class P, bool C, bool BG, bool B> NORMATLAS_ROW
inline void write_group(const typename V::raw* x, const typename V::raw* r, typename V::raw* h, typename V::raw* y,
                        const typename P::raw* g, const typename P::raw* b, float* st, int64_t rows, int64_t n,
                        float eps, float div, int64_t eps_mode, int64_t ahead, bool nt) {
  row_stats8<V>(x, r, h, n, rows, C, eps, div, eps_mode, st);
  const typename V::raw* src = r ? h : x;
  for (int64_t i = 0; i < rows; ++i) {
    const bool more = i < ahead;
    write_row<V, P, C, BG, B>(src + i * n, y + i * n, g, b, st[3 * i], st[3 * i + 1], n,
                              more ? x + (i + 8) * n : nullptr, more && r ? r + (i + 8) * n : nullptr, nt);
  }
}

template <class V, class P>
struct Writer {
  void (*row)(const typename V::raw*, typename V::raw*, const typename P::raw*, const typename P::raw*, float, float,
              int64_t, const typename V::raw*, const typename V::raw*, bool);
  void (*group)(const typename V::raw*, const typename V::raw*, typename V::raw*, typename V::raw*,
                const typename P::raw*, const typename P::raw*, float*, int64_t, int64_t, float, float, int64_t,
                int64_t, bool);
};

// A half-precision model's own parameters are read as they are only by threads with a few rows (kNativeRows in
// norm_kernels.cpp), which need no groups: no write_group for them.
template <class V, class P, bool C, bool BG, bool B>
constexpr Writer<V, P> writer() {
  if constexpr (std::is_same_v<P, V> && !std::is_same_v<V, F32>) return {write_row<V, P, C, BG, B>, nullptr};
  else return {write_row<V, P, C, BG, B>, write_group<V, P, C, BG, B>};
}

template <class V, class P>
inline Writer<V, P> pick_writer(bool center, bool before_gain, bool bias) {
  if constexpr (std::is_same_v<P, NoGain>) {  // no bias either; a cast before a gain of 1 is the cast after it
    return center ? writer<V, P, true, false, false>() : writer<V, P, false, false, false>();
  }
  const int k = (center ? 4 : 0) | (before_gain ? 2 : 0) | (bias ? 1 : 0);
  switch (k) {
    case 0: return writer<V, P, false, false, false>();
    case 1: return writer<V, P, false, false, true>();
    case 2: return writer<V, P, false, true, false>();
    case 3: return writer<V, P, false, true, true>();
    case 4: return writer<V, P, true, false, false>();
    case 5: return writer<V, P, true, false, true>();
    case 6: return writer<V, P, true, true, false>();
    default: return writer<V, P, true, true, true>();
  }
}

// What the gain gradient accumulates: G = kGain: dy * x_hat; G = kGainBeforeCast (the Llama cast order, gain * x_hat
// rounded to the storage dtype): dy * x_hat rounded. 0: no gain gradient.
constexpr int kGain = 1, kGainBeforeCast = 2;
template <class V, int G>
inline __m256 gain_factor(__m256 xc, __m256 rs) {
  const __m256 xh = _mm256_mul_ps(xc, rs);
  return G == kGainBeforeCast ? V::rt(xh) : xh;
}

// The bf16 backward walks whole 16-element blocks in the lane order of BF16::ld2p (lo: elements 0-3 and 8-11, hi:
// 4-7 and 12-15), so that each 16 bf16 elements widen by two unpacks instead of two zero-extensions and two shifts:
// the bf16 backward is bound by its vector instructions, not by memory, at cache size (builds interleaved in one
// process, 2 threads, backward alone with the gain gradient: RMSNorm 0.87-0.90x the time at 256 x 4096,
// 1024 x 1024 and 4096 x 256, 0.98x at 37 x 2051, LayerNorm 0.88x). The gain it multiplies by is a copy in that order
// (lane_order_gain in norm_kernels.cpp); dx and the residual's gradient are read and written in element order, and
// so are the gain / bias partial sums when a call returns (the row-by-row path holds them in the lane order between
// rows: bwd_sums). Each element's arithmetic is the one of the other types; only the row sums add their lanes in
// another order.
template <class V>
constexpr bool kLaneOrder = std::is_same_v<V, BF16>;

// Two fp32 vectors of elements 0-7 and 8-15 into the lane order (lo: 0-3, 8-11; hi: 4-7, 12-15), or back: the same
// exchange of 128-bit halves both ways.
inline void swap_halves(__m256& a, __m256& b) {
  const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
  a = lo;
  b = hi;
}

// n fp32 values between element order and the lane order over their whole 16-element blocks, in place (the same
// exchange both ways; the tail after the last whole block stays): the bf16 backward's gain copy (lane_order_gain) and
// its row-by-row partial sums, put back in element order once a thread's rows are done.
inline void swap_block_halves(float* p, int64_t n) {
  for (int64_t j = 0; j + 16 <= n; j += 16) {
    __m256 lo = _mm256_loadu_ps(p + j), hi = _mm256_loadu_ps(p + j + 8);
    swap_halves(lo, hi);
    _mm256_storeu_ps(p + j, lo);
    _mm256_storeu_ps(p + j + 8, hi);
  }
}

// The backward's first pass over a row (the same algebra as the generic bwd_row), the gain read in P (as
// write_row): the row sums of dxh = dy * g, dxh * xc and xc, turned into the row's dx coefficients k and off; with G
// / Bs also the gain / bias partial sums (so that a row-by-row second pass only reads the now cached row).
// `gl`: the gain in the lane order for bf16 (kLaneOrder), g itself otherwise. The gain / bias partial sums (G / Bs:
// the row-by-row backward) are kept in the lane order too over the row's whole 16-element blocks, put back in element
// order once a thread's rows are done (swap_block_halves): exchanged on every row they took the bf16 backward from
// memory 1.18x the time (2048 x 4096, 8192 x 1024).
template <class V, class P, bool C, int G, bool Bs> NORMATLAS_ROW
inline void bwd_sums(const typename V::raw* x, const typename V::raw* dy, const typename P::raw* g,
                     const typename P::raw* gl, float* pg, float* pb, int64_t n, float mean, float r, float drdms,
                     float div, float& k, float& off) {
  const __m256 mu = _mm256_set1_ps(mean), rs = _mm256_set1_ps(r);
  // two sets of accumulators (even and odd 8-element steps), so consecutive adds do not wait on each other
  __m256 s[2][3];
  for (auto& set : s) set[0] = set[1] = set[2] = _mm256_setzero_ps();
  auto first = [&](int64_t j, mask8 m, __m256* acc) {
    const __m256 d = load<V>(dy + j, m);
    __m256 xc = load<V>(x + j, m);
    if (C) xc = maskz_sub_ps(m, xc, mu);  // masked lanes stay 0 so they add nothing
    const __m256 dxh = _mm256_mul_ps(d, load<P>(g + j, m));
    acc[0] = _mm256_add_ps(acc[0], dxh);
    acc[1] = _mm256_fmadd_ps(dxh, xc, acc[1]);
    if (C) acc[2] = _mm256_add_ps(acc[2], xc);
    if (G) storef(pg + j, m, _mm256_fmadd_ps(d, gain_factor<V, G>(xc, rs), loadf(pg + j, m)));
    if (Bs) storef(pb + j, m, _mm256_add_ps(d, loadf(pb + j, m)));
  };
  // the row's sums over [j, je): whole 16-element blocks (bf16: in the lane order, s[0] summing lo, s[1] hi), then
  // 8-element steps with the tail masked
  auto span = [&](int64_t j, int64_t je) {
    if constexpr (kLaneOrder<V>) {  // whole 16-element blocks in the lane order; s[0] sums lo, s[1] hi
      for (; j + 16 <= je; j += 16) {
        __m256 d[2], xc[2], sg[2], sb[2];
        V::ld2p(dy + j, d[0], d[1]);
        V::ld2p(x + j, xc[0], xc[1]);
        if (G) {
          sg[0] = _mm256_loadu_ps(pg + j);
          sg[1] = _mm256_loadu_ps(pg + j + 8);
        }
        if (Bs) {
          sb[0] = _mm256_loadu_ps(pb + j);
          sb[1] = _mm256_loadu_ps(pb + j + 8);
        }
        for (int q = 0; q < 2; ++q) {
          if (C) xc[q] = _mm256_sub_ps(xc[q], mu);
          const __m256 dxh = _mm256_mul_ps(d[q], load<P>(gl + j + 8 * q, 0xff));
          s[q][0] = _mm256_add_ps(s[q][0], dxh);
          s[q][1] = _mm256_fmadd_ps(dxh, xc[q], s[q][1]);
          if (C) s[q][2] = _mm256_add_ps(s[q][2], xc[q]);
          if (G) sg[q] = _mm256_fmadd_ps(d[q], gain_factor<V, G>(xc[q], rs), sg[q]);
          if (Bs) sb[q] = _mm256_add_ps(d[q], sb[q]);
        }
        if (G) {
          _mm256_storeu_ps(pg + j, sg[0]);
          _mm256_storeu_ps(pg + j + 8, sg[1]);
        }
        if (Bs) {
          _mm256_storeu_ps(pb + j, sb[0]);
          _mm256_storeu_ps(pb + j + 8, sb[1]);
        }
      }
    }
    for (; j + 16 <= je; j += 16) {
      first(j, 0xff, s[0]);
      first(j + 8, 0xff, s[1]);
    }
    for (; j < je; j += 8) first(j, j + 8 <= je ? static_cast<mask8>(0xff) : tail_mask(je - j), s[0]);
  };
  if (n <= kWideRow) {
    span(0, n);
    const float s_dxh = hsum(_mm256_add_ps(s[0][0], s[1][0]));
    const float s_dxh_xc = hsum(_mm256_add_ps(s[0][1], s[1][1]));
    const float s_xc = C ? hsum(_mm256_add_ps(s[0][2], s[1][2])) : 0.f;
    k = drdms * 2.f / div * s_dxh_xc;
    off = C ? (r * s_dxh + k * s_xc) / static_cast<float>(n) : 0.f;
    return;
  }
  // a wide row: each block's fp32 lanes folded into fp64 (Wide) and k, off computed in fp64, as the forward's statistics
  Wide w[3];
  for (int64_t jb = 0; jb < n; jb += kSumBlock) {
    span(jb, std::min(n, jb + kSumBlock));
    for (int t = 0; t < (C ? 3 : 2); ++t) {
      w[t].add(_mm256_add_ps(s[0][t], s[1][t]));
      s[0][t] = s[1][t] = _mm256_setzero_ps();
    }
  }
  const double kd = static_cast<double>(drdms) * 2.0 / static_cast<double>(div) * w[1].sum();
  k = static_cast<float>(kd);
  off = C ? static_cast<float>((static_cast<double>(r) * w[0].sum() + kd * w[2].sum()) / static_cast<double>(n)) : 0.f;
}

// The backward's second pass over columns [j0, j1) of a row (k, off from bwd_sums): dx = r dy g + k xc - off (+ the
// residual's gradient); with G / Bs the gain / bias partial sums here instead (the tiled order: bwd_impl). With `nx`
// set (inputs streaming from memory) it prefetches the next row's x, dy and d_residual (`nx`, `ndy`, `ndr`) so that
// the next first pass finds them in cache.
template <class V, class P, bool C, int G, bool Bs, bool DR> NORMATLAS_ROW
inline void bwd_cols(const typename V::raw* x, const typename V::raw* dy, const typename V::raw* dr,
                     typename V::raw* dx, const typename P::raw* g, float* pg, float* pb, int64_t j0, int64_t j1,
                     float mean, float r, float k, float off, const typename V::raw* nx, const typename V::raw* ndy,
                     const typename V::raw* ndr, bool nt) {
  const __m256 mu = _mm256_set1_ps(mean), rs = _mm256_set1_ps(r);
  const __m256 kv = _mm256_set1_ps(k), offv = _mm256_set1_ps(off);
  nt = nt && line_aligned(dx);
  constexpr int64_t kLine = 64 / sizeof(typename V::raw);
  each8(j1 - j0, [&](int64_t jj, mask8 m) {
    const int64_t j = j0 + jj;
    if (nx && j % kLine == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(nx + j), NORMATLAS_NEXT_ROW);
      _mm_prefetch(reinterpret_cast<const char*>(ndy + j), NORMATLAS_NEXT_ROW);
      if (DR) _mm_prefetch(reinterpret_cast<const char*>(ndr + j), NORMATLAS_NEXT_ROW);
    }
    __m256 xc = load<V>(x + j, m);
    if (C) xc = _mm256_sub_ps(xc, mu);
    const __m256 d = load<V>(dy + j, m);
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(rs, d), load<P>(g + j, m));
    v = _mm256_fmadd_ps(kv, xc, v);
    if (C) v = _mm256_sub_ps(v, offv);
    if (DR) v = _mm256_add_ps(v, load<V>(dr + j, m));
    if (nt && m == 0xff) V::st_nt(dx + j, v);
    else store<V>(dx + j, v, m);
    if (G) storef(pg + j, m, _mm256_fmadd_ps(d, gain_factor<V, G>(xc, rs), loadf(pg + j, m)));
    if (Bs) storef(pb + j, m, _mm256_add_ps(d, loadf(pb + j, m)));
  });
}

// The tiled backward's second pass over one chunk of kChunk columns starting at j0, for `rows` rows `stride` apart
// (their row statistics `st`, dx coefficients `k` and `off` from bwd_sums): the chunk's gain / bias partial sums stay
// in registers across the rows, loaded and stored once per chunk rather than once per row. Same arithmetic in the
// same order as bwd_cols row after row.
// With AVX2 the chunks also replace VMASKMOVPS stores of the partial sums (storef): the AVX2 backward from cache
// took 0.28-0.57x the time of the strips (256 x 4096, 1024 x 1024, 4096 x 256, fp32 / bf16, RMSNorm / LayerNorm).
#if NORMATLAS_VEC512
constexpr int kChunkVecs = 8;  // 32 vector registers: 8 gains, 8 gain and 8 bias sums beside the row's constants
#else
constexpr int kChunkVecs = 4;  // 16 with AVX2
#endif
constexpr int64_t kChunk = 8 * kChunkVecs;
static_assert(kChunkVecs % 2 == 0, "bwd_chunk's bf16 lane order takes its vectors in pairs (16-element blocks)");

// `g`: the gain in the lane order for bf16 (kLaneOrder; j0 is a multiple of kChunk), in element order otherwise.
template <class V, class P, bool C, int G, bool Bs, bool DR> NORMATLAS_ROW
inline void bwd_chunk(const typename V::raw* x, const typename V::raw* dy, const typename V::raw* dr,
                      typename V::raw* dx, int64_t stride, int64_t rows, const typename P::raw* g, float* pg,
                      float* pb, int64_t j0, const float* st, const float* k, const float* off) {
  __m256 ag[kChunkVecs], ab[kChunkVecs], gv[kChunkVecs];
  for (int u = 0; u < kChunkVecs; ++u) {
    gv[u] = load<P>(g + j0 + 8 * u, 0xff);
    ag[u] = G ? _mm256_loadu_ps(pg + j0 + 8 * u) : _mm256_setzero_ps();
    ab[u] = Bs ? _mm256_loadu_ps(pb + j0 + 8 * u) : _mm256_setzero_ps();
  }
  if constexpr (kLaneOrder<V>) {  // the partial sums in the lane order too, so each pairs with its gain and column
    for (int u = 0; u < kChunkVecs; u += 2) {
      if (G) swap_halves(ag[u], ag[u + 1]);
      if (Bs) swap_halves(ab[u], ab[u + 1]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t o = i * stride + j0;
    const __m256 mu = _mm256_set1_ps(st[3 * i]), rs = _mm256_set1_ps(st[3 * i + 1]);
    const __m256 kv = _mm256_set1_ps(k[i]), offv = _mm256_set1_ps(off[i]);
    if constexpr (kLaneOrder<V>) {
      for (int u = 0; u < kChunkVecs; u += 2) {
        const int64_t j = o + 8 * u;
        __m256 xc[2], d[2], v[2], rr[2];
        V::ld2p(x + j, xc[0], xc[1]);
        V::ld2p(dy + j, d[0], d[1]);
        if (DR) V::ld2p(dr + j, rr[0], rr[1]);
        for (int q = 0; q < 2; ++q) {
          if (C) xc[q] = _mm256_sub_ps(xc[q], mu);
          v[q] = _mm256_mul_ps(_mm256_mul_ps(rs, d[q]), gv[u + q]);
          v[q] = _mm256_fmadd_ps(kv, xc[q], v[q]);
          if (C) v[q] = _mm256_sub_ps(v[q], offv);
          if (DR) v[q] = _mm256_add_ps(v[q], rr[q]);
          if (G) ag[u + q] = _mm256_fmadd_ps(d[q], gain_factor<V, G>(xc[q], rs), ag[u + q]);
          if (Bs) ab[u + q] = _mm256_add_ps(d[q], ab[u + q]);
        }
        V::st2p(dx + j, v[0], v[1]);
      }
      continue;
    }
    for (int u = 0; u < kChunkVecs; ++u) {
      const int64_t j = o + 8 * u;
      __m256 xc = V::ld(x + j);
      if (C) xc = _mm256_sub_ps(xc, mu);
      const __m256 d = V::ld(dy + j);
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(rs, d), gv[u]);
      v = _mm256_fmadd_ps(kv, xc, v);
      if (C) v = _mm256_sub_ps(v, offv);
      if (DR) v = _mm256_add_ps(v, V::ld(dr + j));
      V::st(dx + j, v);
      if (G) ag[u] = _mm256_fmadd_ps(d, gain_factor<V, G>(xc, rs), ag[u]);
      if (Bs) ab[u] = _mm256_add_ps(d, ab[u]);
    }
  }
  if constexpr (kLaneOrder<V>) {
    for (int u = 0; u < kChunkVecs; u += 2) {
      if (G) swap_halves(ag[u], ag[u + 1]);
      if (Bs) swap_halves(ab[u], ab[u + 1]);
    }
  }
  for (int u = 0; u < kChunkVecs; ++u) {
    if (G) _mm256_storeu_ps(pg + j0 + 8 * u, ag[u]);
    if (Bs) _mm256_storeu_ps(pb + j0 + 8 * u, ab[u]);
  }
}

// The tiled backward's second pass over columns [j0, n), fewer than kChunk (a short row, or what follows the chunks):
// one vector of columns at a time down the block's rows, its gain / bias partial sums in registers as in bwd_chunk
// (row by row they went through memory, each row's update waiting on the previous row's store). The same arithmetic
// in the same order as bwd_cols row after row.
template <class V, class P, bool C, int G, bool Bs, bool DR> NORMATLAS_ROW
inline void bwd_narrow(const typename V::raw* x, const typename V::raw* dy, const typename V::raw* dr,
                       typename V::raw* dx, int64_t stride, int64_t rows, const typename P::raw* g, float* pg,
                       float* pb, int64_t j0, int64_t n, const float* st, const float* k, const float* off) {
  each8(n - j0, [&](int64_t jj, mask8 m) {
    const int64_t j = j0 + jj;
    const __m256 gv = load<P>(g + j, m);
    __m256 ag = G ? loadf(pg + j, m) : _mm256_setzero_ps();
    __m256 ab = Bs ? loadf(pb + j, m) : _mm256_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t o = i * stride + j;
      const __m256 rs = _mm256_set1_ps(st[3 * i + 1]);
      __m256 xc = load<V>(x + o, m);
      if (C) xc = _mm256_sub_ps(xc, _mm256_set1_ps(st[3 * i]));
      const __m256 d = load<V>(dy + o, m);
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(rs, d), gv);
      v = _mm256_fmadd_ps(_mm256_set1_ps(k[i]), xc, v);
      if (C) v = _mm256_sub_ps(v, _mm256_set1_ps(off[i]));
      if (DR) v = _mm256_add_ps(v, load<V>(dr + o, m));
      store<V>(dx + o, v, m);
      if (G) ag = _mm256_fmadd_ps(d, gain_factor<V, G>(xc, rs), ag);
      if (Bs) ab = _mm256_add_ps(d, ab);
    }
    if (G) storef(pg + j, m, ag);
    if (Bs) storef(pb + j, m, ab);
  });
}

// One row of the backward, row by row: bwd_sums (with the gain / bias partial sums), then bwd_cols over the row.
template <class V, class P, bool C, int G, bool Bs, bool DR>
inline void bwd_row(const typename V::raw* x, const typename V::raw* dy, const typename V::raw* dr,
                    typename V::raw* dx, const typename P::raw* g, const typename P::raw* gl, float* pg, float* pb,
                    int64_t n, float mean, float r, float drdms, float div, const typename V::raw* nx,
                    const typename V::raw* ndy, const typename V::raw* ndr, bool nt) {
  float k, off;
  bwd_sums<V, P, C, G, Bs>(x, dy, g, gl, pg, pb, n, mean, r, drdms, div, k, off);
  bwd_cols<V, P, C, 0, false, DR>(x, dy, dr, dx, g, nullptr, nullptr, 0, n, mean, r, k, off, nx, ndy, ndr, nt);
}

}  // namespace vec
