// The one place where every native op is registered: schema in TORCH_LIBRARY, kernels per dispatch
// key. python/retouch/ops.py is the only Python module that imports the resulting retouch._C.
#include <torch/extension.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(retouch, m) {
  m.def("gather_rows(Tensor src, Tensor row_idx) -> Tensor");
  m.def("scatter_rows_(Tensor(a!) dst, Tensor row_idx, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(retouch, CPU, m) {
  m.impl("gather_rows", &retouch::gather_rows_cpu);
  m.impl("scatter_rows_", &retouch::scatter_rows_cpu);
}

#ifdef RETOUCH_WITH_CUDA
TORCH_LIBRARY_IMPL(retouch, CUDA, m) {
  m.impl("gather_rows", &retouch::gather_rows_cuda);
  m.impl("scatter_rows_", &retouch::scatter_rows_cuda);
}
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "retouch native ops; use them through retouch.ops";
  m.def("built_with_cuda", [] { return kBuiltWithCuda; }, "True if the CUDA kernels were compiled in");
}
