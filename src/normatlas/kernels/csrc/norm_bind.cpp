// The Python module of the CPU kernels: norm_ops.h's functions, bound with torch's pybind11 casters for tensors.
#include <torch/csrc/utils/pybind.h>

#include "norm_kernels.h"
#include "norm_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "normatlas fused normalization CPU kernels";
  m.def("norm_fwd", &normatlas::norm_fwd, "forward of the custom op: (y, h, stats)");
  m.def("norm_bwd", &normatlas::norm_bwd, "backward of the custom op: (dx, dgain, dbias)");
  m.def("norm", &normatlas::norm, "eager forward with the backward in C++: (y, h)");
  // module_local: builds of the kernels for other instruction sets load beside this one (tests/test_kernels_isa.py),
  // each with its own Plan type
  pybind11::class_<normatlas::Plan>(m, "Plan", pybind11::module_local(),
                                    "one (spec, dtype)'s eager hot path: call(x, residual, weight, bias, fshape) -> "
                                    "(y, h), or None where the checked path must run")
      .def(pybind11::init<int64_t, bool, bool, bool, double, bool, int64_t, bool, bool, bool>())
      .def("__call__", &normatlas::Plan::operator())
      .def("pair", &normatlas::Plan::pair, "norm_pair with the plan's flags: (yq, yk)");
  m.def("norm_pair", &normatlas::norm_pair, "two forwards in one parallel region (QK-norm, no autograd): (yq, yk)");
  m.def("affine_floor", &normatlas::affine_floor, "the output pass alone, y = x * s * weight (benchmark floor)");
  m.def("vector_kernels", &normatlas::vector_kernels,
        "the instruction set of the explicit-vector row kernels: 'avx512', 'avx2', or '' (generic templates)");
}
