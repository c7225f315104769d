// The one place where every native op is registered: schema in TORCH_LIBRARY, kernels per dispatch
// key. python/retouch/ops.py is the only Python module that imports the resulting retouch._C.
#include <torch/extension.h>
#include <torch/library.h>

#include "host_arena.h"
#include "ops.h"

TORCH_LIBRARY(retouch, m) {
  m.def("gather_rows(Tensor src, Tensor row_idx) -> Tensor");
  m.def("scatter_rows_(Tensor(a!) dst, Tensor row_idx, Tensor src) -> ()");
  m.def("gather_host_rows_(Tensor(a!) dst, Tensor src, Tensor src_offsets, Tensor dst_rows, str method, "
        "int max_blocks=0) -> ()");
  m.def("rope_pairs(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rms_norm_rope(Tensor x, Tensor? weight, float eps, Tensor? cos, Tensor? sin) -> Tensor");
  m.def("sdpa_ragged(Tensor q, Tensor k, Tensor v, Tensor lengths_q, Tensor lengths_k, float scale) -> Tensor");
}

// Built from ATen ops: one implementation for every device (a device's own kernel, below or registered
// from Python, takes precedence).
TORCH_LIBRARY_IMPL(retouch, CompositeExplicitAutograd, m) {
  m.impl("rope_pairs", &retouch::rope_pairs);
  m.impl("rms_norm_rope", &retouch::rms_norm_rope);
  m.impl("sdpa_ragged", &retouch::sdpa_ragged);
}

TORCH_LIBRARY_IMPL(retouch, CPU, m) {
  m.impl("gather_rows", &retouch::gather_rows_cpu);
  m.impl("scatter_rows_", &retouch::scatter_rows_cpu);
  m.impl("gather_host_rows_", &retouch::gather_host_rows_cpu);
  m.impl("rope_pairs", &retouch::rope_pairs_cpu);
  m.impl("rms_norm_rope", &retouch::rms_norm_rope_cpu);
}

#ifdef RETOUCH_WITH_CUDA
TORCH_LIBRARY_IMPL(retouch, CUDA, m) {
  m.impl("gather_rows", &retouch::gather_rows_cuda);
  m.impl("scatter_rows_", &retouch::scatter_rows_cuda);
  // Chosen whenever dst is a CUDA tensor: the dispatcher takes the highest-priority key among all
  // tensor arguments, and src and the indices are CPU tensors.
  m.impl("gather_host_rows_", &retouch::gather_host_rows_cuda);
}
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "retouch native ops; use them through retouch.ops";
  m.def("built_with_cuda", [] { return kBuiltWithCuda; }, "True if the CUDA kernels were compiled in");

  // A class, not an op: it owns memory and state. The GIL is released inside every method that takes
  // the arena's mutex, so Python threads contend on that mutex, never hold it while waiting for the GIL.
  using retouch::HostArena;
  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<HostArena, std::shared_ptr<HostArena>>(m, "HostArena",
                                                   "One pinned host buffer, sub-allocated with alignment and "
                                                   "reference counts (see csrc/host_arena.h)")
      .def(py::init<int64_t, int64_t, bool>(), py::arg("capacity"), py::arg("alignment") = 256,
           py::arg("pinned") = true, release_gil())
      .def_property_readonly("capacity", &HostArena::capacity)
      .def_property_readonly("alignment", &HostArena::alignment)
      .def_property_readonly("pinned", &HostArena::pinned, "True if the buffer is page-locked (cudaHostAlloc)")
      .def_property_readonly("used", py::cpp_function(&HostArena::used, release_gil()),
                             "bytes held by live allocations")
      .def_property_readonly("largest_free", py::cpp_function(&HostArena::largest_free, release_gil()))
      .def_property_readonly("num_allocations", py::cpp_function(&HostArena::num_allocations, release_gil()))
      .def("allocate", &HostArena::allocate, py::arg("nbytes"), release_gil(),
           "offset of a new aligned allocation with refcount 1, or -1 when no free range fits")
      .def("retain", &HostArena::retain, py::arg("offset"), release_gil())
      .def("release", &HostArena::release, py::arg("offset"), release_gil(),
           "drop one reference; True when that freed the allocation")
      .def("refcount", &HostArena::refcount, py::arg("offset"), release_gil(), "0 if offset is not live")
      .def("size", &HostArena::size, py::arg("offset"), release_gil(), "the allocation's aligned size")
      .def("tensor", &HostArena::tensor, "uint8 [capacity] CPU tensor sharing the buffer (keeps it alive)");
}
