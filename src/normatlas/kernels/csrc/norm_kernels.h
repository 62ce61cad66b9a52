// The row kernels' interface: plain pointers and flags, no torch headers.
//
// norm_kernels.cpp implements it (the arithmetic, compiled -O3 -march=native with only ATen/Parallel.h and the c10
// scalar types); norm_bind.cpp turns tensors into these calls and binds them to Python. Two translation units built
// in parallel: the torch headers the binding needs take most of a one-file build's time, and the kernels no longer
// wait for them.
#pragma once

#include <cstdint>

namespace normatlas {

// A storage dtype: of x, y, h, dy, dx, and of a gain or bias as given (Param). The kernels compute gains, biases,
// statistics and gain gradients in the accumulation dtype: double for F64, float otherwise.
enum class Dtype : int { F32 = 0, F64 = 1, BF16 = 2, F16 = 3 };

enum EpsMode : int64_t { INSIDE = 0, OUTSIDE = 1, CLAMP = 2 };

// The scalar flags of one normalization.
struct RowFlags {
  double eps;
  bool center;       // subtract the mean (LayerNorm)
  int64_t eps_mode;  // EpsMode
  bool before_gain;  // cast x_hat to the storage dtype before the gain (HF Llama order)
  bool l2;           // divide by the L2 norm instead of the RMS
};

// A per-feature vector, a gain or a bias, as the caller holds it: n contiguous values of `dtype` at `data`, or none
// (data null: a gain of 1, no bias). Each worker thread reads it as it needs it: in place when it already is the
// accumulation dtype and no 1 + w is asked for, in its own half-precision dtype over a few rows (the vector kernels),
// else converted into a buffer of the thread's own, so that a converted copy is written and read by the same core.
struct Param {
  const void* data;
  Dtype dtype;
  bool plus_one;  // the multiplier is 1 + w (Gemma's convention)
  bool round;     // with plus_one: 1 + w rounded in `dtype` first, as torch's `1 + w` before a cast-before-gain product
};

// y = affine(norm(src)) for `rows` rows of n, src = x, or h = x + res (written out) when res is set. stats: per
// row (mean, rstd, d rstd / d ms). `parallel`: split rows over the intra-op pool (false inside a caller's region).
void forward(Dtype t, const void* x, const void* res, void* h, void* y, const Param& gain, const Param& bias,
             void* stats, int64_t rows, int64_t n, const RowFlags& f, bool parallel);

// dx (+ dres when set) from dy, the forward's input x (or h) and stats; dgain / dbias (zeroed, may be null) get
// the gain / bias gradients.
void backward(Dtype t, const void* dy, const void* x, const void* dres, void* dx, const Param& gain,
              const void* stats, void* dgain, void* dbias, int64_t rows, int64_t n, const RowFlags& f);

// Two normalizations in one parallel region split over their rows together (QK-norm for inference).
void forward_pair(Dtype t, const void* q, const void* k, void* yq, void* yk, const Param& gq, const Param& gk,
                  void* stats, int64_t rows_q, int64_t rows_k, int64_t n, const RowFlags& f);

// The output pass alone, y = x * s * g (no statistics): the floor under any norm forward, for the benchmarks.
void affine_floor_rows(Dtype t, const void* x, void* y, const Param& g, float s, int64_t rows, int64_t n);

// Before the first write into a newly allocated output: transparent huge pages for a fresh mapping (see the .cpp).
void advise_output(void* p, int64_t bytes);

// The instruction set of the explicit-vector row kernels compiled in: "avx512", "avx2", or "" (generic templates).
const char* vector_kernels();

}  // namespace normatlas
