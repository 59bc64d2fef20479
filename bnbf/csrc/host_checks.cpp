// Host-side checks of an in-place step, over whole lists of tensors in one call each.
//
// A GPT-2-sized step has 148 grads; reading shape, dtype, device, contiguity and the data pointer of each
// through Python attributes costs ~60 us of host time before the first launch, as much as a fifth of the
// kernel's time. Here the same reads are C++ member calls (~10 ns per tensor). Built and loaded by
// bnbf/_native.py; bnbf/_host.py holds the pure-Python twins, which run wherever this cannot be built.
//
// Every function answers a yes/no question and never raises for unexpected input: "no" sends the caller
// down the slow path, which names what is wrong.

#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

namespace {

// The tensor of a plain torch.Tensor or nn.Parameter object, else nullptr. Other subclasses may answer
// Python attribute reads differently from their C++ metadata, so they take the slow path.
const at::Tensor* plain_tensor(PyObject* obj) {
  return THPVariableClass != nullptr && THPVariable_CheckExact(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

// The tensor of any torch.Tensor object, subclasses included, else nullptr.
const at::Tensor* any_tensor(PyObject* obj) {
  return THPVariable_Check(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

// A C++ exception is a "no"; a Python error it left behind is dropped with it.
PyObject* no() {
  PyErr_Clear();
  Py_RETURN_FALSE;
}

bool two_args(Py_ssize_t nargs) {
  if (nargs == 2) return true;
  PyErr_Format(PyExc_TypeError, "expected 2 arguments, got %zd", nargs);
  return false;
}

// grads_match(params, grads) -> bool: each grad a plain, dense, contiguous tensor with its param's shape,
// dtype and device. params are the checked params of a plan (a list); grads a list or tuple.
PyObject* grads_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs)) return nullptr;
  PyObject *params = args[0], *grads = args[1];
  if (!PyList_Check(params) || !(PyList_Check(grads) || PyTuple_Check(grads))) Py_RETURN_FALSE;
  const Py_ssize_t n = PyList_GET_SIZE(params);
  if (PySequence_Fast_GET_SIZE(grads) != n) Py_RETURN_FALSE;
  PyObject** gs = PySequence_Fast_ITEMS(grads);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* p = any_tensor(PyList_GET_ITEM(params, i));
      const at::Tensor* g = plain_tensor(gs[i]);
      if (p == nullptr || g == nullptr) Py_RETURN_FALSE;
      if (g->layout() != c10::kStrided || g->scalar_type() != p->scalar_type() || g->device() != p->device() ||
          g->sizes() != p->sizes() || !g->is_contiguous()) {
        Py_RETURN_FALSE;
      }
    }
  } catch (const std::exception&) {  // metadata that cannot be read here: the slow path will tell
    return no();
  }
  Py_RETURN_TRUE;
}

// ptrs_equal(tensors, ptrs) -> bool: tensors[i].data_ptr() == ptrs[i] for all i (a list or tuple of
// tensors, subclasses included, and a tuple of ints), as Python's Tensor.data_ptr() reads it.
PyObject* ptrs_equal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!two_args(nargs)) return nullptr;
  PyObject *tensors = args[0], *ptrs = args[1];
  if (!(PyList_Check(tensors) || PyTuple_Check(tensors)) || !PyTuple_Check(ptrs)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
  if (PyTuple_GET_SIZE(ptrs) != n) Py_RETURN_FALSE;
  PyObject** ts = PySequence_Fast_ITEMS(tensors);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* t = any_tensor(ts[i]);
      if (t == nullptr) Py_RETURN_FALSE;
      const unsigned long long want = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ptrs, i));
      if (want == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_FALSE;
      }
      if (reinterpret_cast<uintptr_t>(t->data_ptr()) != want) Py_RETURN_FALSE;
    }
  } catch (const std::exception&) {  // e.g. a tensor without storage
    return no();
  }
  Py_RETURN_TRUE;
}

// grads_of(params) -> (grads, every): each param's .grad (None where it has none) as a new list, and
// whether every param has one. Plain tensors' grads are read in C++; any other object's through Python.
PyObject* grads_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) {
    PyErr_Format(PyExc_TypeError, "expected 1 argument, got %zd", nargs);
    return nullptr;
  }
  PyObject* params = args[0];
  if (!(PyList_Check(params) || PyTuple_Check(params))) {
    PyErr_SetString(PyExc_TypeError, "grads_of expects a list or tuple of params");
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(params);
  PyObject** ps = PySequence_Fast_ITEMS(params);
  PyObject* grads = PyList_New(n);
  if (grads == nullptr) return nullptr;
  bool every = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = nullptr;
    const at::Tensor* p = plain_tensor(ps[i]);
    if (p != nullptr) {
      const at::Tensor& grad = p->grad();
      if (grad.defined()) {
        g = THPVariable_Wrap(grad);
      } else {
        Py_INCREF(Py_None);
        g = Py_None;
      }
    } else {
      g = PyObject_GetAttrString(ps[i], "grad");
    }
    if (g == nullptr) {
      Py_DECREF(grads);
      return nullptr;
    }
    every = every && g != Py_None;
    PyList_SET_ITEM(grads, i, g);  // steals the reference
  }
  PyObject* out = Py_BuildValue("(NO)", grads, every ? Py_True : Py_False);
  return out;
}

// set_each(objs, key, value) -> None: objs[i][key] = value for every i (a list or tuple of mappings).
PyObject* set_each(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "expected 3 arguments, got %zd", nargs);
    return nullptr;
  }
  PyObject *objs = args[0], *key = args[1], *value = args[2];
  if (!(PyList_Check(objs) || PyTuple_Check(objs))) {
    PyErr_SetString(PyExc_TypeError, "set_each expects a list or tuple");
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(objs);
  PyObject** os = PySequence_Fast_ITEMS(objs);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int rc = PyDict_CheckExact(os[i]) ? PyDict_SetItem(os[i], key, value) : PyObject_SetItem(os[i], key, value);
    if (rc != 0) return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"grads_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_match)), METH_FASTCALL, "grads_match(params, grads) -> bool"},
    {"ptrs_equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ptrs_equal)), METH_FASTCALL, "ptrs_equal(tensors, ptrs) -> bool"},
    {"grads_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_of)), METH_FASTCALL, "grads_of(params) -> (grads, every)"},
    {"set_each", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_each)), METH_FASTCALL, "set_each(objs, key, value) -> None"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "bnbf_host_checks", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_bnbf_host_checks(void) { return PyModule_Create(&module); }
