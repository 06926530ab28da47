// The per-tensor checks of `small_tensors.one_run`, in one pass over the leaves without a Python call per
// tensor: an optional extension (setup.py builds it where torch is importable at build time, and
// `small_tensors` reads the same facts in Python when it is absent or built against another torch).
#include <torch/extension.h>

#include <unordered_set>

namespace {

// The byte size of each leaf when every one is a plain `tensor_type` (exactly: no subclass) of the first
// one's dtype, strided, on the host, 1-D, contiguous from the start of a storage it spans alone (no storage
// twice), without the negative or conjugate bit or grad, of more than `itemsize` and at most `most` bytes;
// else None. Python checks the first leaf's dtype and dimensions before the call.
py::object run_sizes(const py::list& leaves, int64_t most, const py::handle& tensor_type) {
  const size_t n = leaves.size();
  if (n == 0) {
    return py::none();
  }
  PyTypeObject* exact = reinterpret_cast<PyTypeObject*>(tensor_type.ptr());
  std::vector<int64_t> sizes;
  sizes.reserve(n);
  std::unordered_set<const void*> storages;
  storages.reserve(2 * n);
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  for (size_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(leaves.ptr(), static_cast<Py_ssize_t>(i));
    if (Py_TYPE(obj) != exact) {
      return py::none();
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (i == 0) {
      dtype = t.scalar_type();
    }
    if (t.scalar_type() != dtype || t.layout() != at::kStrided || t.is_nested() || !t.has_storage() ||
        !t.device().is_cpu() || t.dim() != 1 || t.requires_grad() || t.is_neg() || t.is_conj()) {
      return py::none();
    }
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    if (nbytes <= static_cast<int64_t>(t.element_size()) || nbytes > most) {
      return py::none();
    }
    if (t.storage_offset() != 0 || !t.is_contiguous()) {
      return py::none();
    }
    const c10::Storage& storage = t.storage();
    if (static_cast<int64_t>(storage.nbytes()) != nbytes || !storages.insert(storage.data()).second) {
      return py::none();
    }
    sizes.push_back(nbytes);
  }
  return py::cast(sizes);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The per-tensor checks of functional_state.memory.small_tensors.one_run, in C++.";
  m.def("run_sizes", &run_sizes, py::arg("leaves"), py::arg("most"), py::arg("tensor_type"));
}
