// The plan's per-step checks over whole lists of tensors, one C++ call each (bnbf/_host_checks.py holds their
// pure-Python twins, which serve where this extension was not built and are its test oracle).
//
// Built at install time by torch's own tooling (setup.py, torch.utils.cpp_extension), never at run time.
// Every function answers a yes/no question and never raises for unexpected input: "no" sends the caller down
// the slow path, which names what is wrong.

#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

namespace {

// The tensor of a plain torch.Tensor or nn.Parameter object, else nullptr: other subclasses may answer
// Python attribute reads differently from their C++ metadata, so they take the slow path.
const at::Tensor* plain_tensor(PyObject* obj) {
  return THPVariableClass != nullptr && THPVariable_CheckExact(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

// A C++ exception is a "no"; a Python error it left behind is dropped with it.
PyObject* no() {
  PyErr_Clear();
  Py_RETURN_FALSE;
}

bool nargs_is(Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
  return false;
}

bool is_seq(PyObject* obj) { return PyList_Check(obj) || PyTuple_Check(obj); }

// grads_match(params, grads) -> bool: each grad a plain, dense, contiguous tensor with its param's shape,
// dtype and device (params: a plan's checked params).
PyObject* grads_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *params = args[0], *grads = args[1];
  if (!is_seq(params) || !is_seq(grads)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(params);
  if (PySequence_Fast_GET_SIZE(grads) != n) Py_RETURN_FALSE;
  PyObject** ps = PySequence_Fast_ITEMS(params);
  PyObject** gs = PySequence_Fast_ITEMS(grads);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* p = plain_tensor(ps[i]);
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

// meta_match(tensors, planned) -> bool: each tensor plain, contiguous, with the shape and dtype of its planned
// twin (a meta tensor made when the plan was built): what resize_, t_, set_ or .data = would change.
PyObject* meta_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *tensors = args[0], *planned = args[1];
  if (!is_seq(tensors) || !is_seq(planned)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
  if (PySequence_Fast_GET_SIZE(planned) != n) Py_RETURN_FALSE;
  PyObject** ts = PySequence_Fast_ITEMS(tensors);
  PyObject** ms = PySequence_Fast_ITEMS(planned);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* t = plain_tensor(ts[i]);
      if (t == nullptr || !THPVariable_CheckExact(ms[i])) Py_RETURN_FALSE;
      const at::Tensor& m = THPVariable_Unpack(ms[i]);
      if (t->scalar_type() != m.scalar_type() || t->sizes() != m.sizes() || !t->is_contiguous()) Py_RETURN_FALSE;
    }
  } catch (const std::exception&) {
    return no();
  }
  Py_RETURN_TRUE;
}

// One tensor's address against want; false for anything else.
bool ptr_is(PyObject* obj, uint64_t want) {
  // the exact-type test first: a pointer comparison, where THPVariable_Check is an isinstance
  if (!THPVariable_CheckExact(obj) && !THPVariable_Check(obj)) return false;
  // const_data_ptr: the address without materializing a copy-on-write tensor (a check has no side effect)
  return reinterpret_cast<uintptr_t>(THPVariable_Unpack(obj).const_data_ptr()) == want;
}

// ptrs_equal(tensors, ptrs[, nested]) -> bool: tensors[i].data_ptr() == ptrs[i] for all i, ptrs packed as
// native uint64 (bytes of array("Q", ...)): no Python int to convert per tensor. With nested, tensors is a
// sequence of tuples of tensors (states), compared field by field in order.
PyObject* ptrs_equal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 && !nargs_is(nargs, 3)) return nullptr;
  PyObject *tensors = args[0], *ptrs = args[1];
  const bool nested = nargs == 3 && PyObject_IsTrue(args[2]) == 1;
  if (!is_seq(tensors) || !PyBytes_Check(ptrs)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
  const Py_ssize_t total = PyBytes_GET_SIZE(ptrs) / static_cast<Py_ssize_t>(sizeof(uint64_t));
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(ptrs));
  PyObject** ts = PySequence_Fast_ITEMS(tensors);
  try {
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!nested) {
        if (k >= total || !ptr_is(ts[i], want[k++])) Py_RETURN_FALSE;
        continue;
      }
      if (!PyTuple_Check(ts[i])) Py_RETURN_FALSE;
      for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(ts[i]); ++j) {
        if (k >= total || !ptr_is(PyTuple_GET_ITEM(ts[i], j), want[k++])) Py_RETURN_FALSE;
      }
    }
    if (k != total) Py_RETURN_FALSE;
  } catch (const std::exception&) {  // e.g. a tensor without storage
    return no();
  }
  Py_RETURN_TRUE;
}

// same_objects(objs, packed) -> bool: objs[i] is the object whose address and type address are packed[2i] and
// packed[2i + 1] (native uint64): the very objects a cached plan was built for, while none of them was freed.
PyObject* same_objects(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *objs = args[0], *packed = args[1];
  if (!is_seq(objs) || !PyBytes_Check(packed)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(objs);
  if (PyBytes_GET_SIZE(packed) != 2 * n * static_cast<Py_ssize_t>(sizeof(uint64_t))) Py_RETURN_FALSE;
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(packed));
  PyObject** os = PySequence_Fast_ITEMS(objs);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (reinterpret_cast<uintptr_t>(os[i]) != want[2 * i] ||
        reinterpret_cast<uintptr_t>(Py_TYPE(os[i])) != want[2 * i + 1]) {
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// grads_of(params) -> (grads, every): each param's .grad (None where it has none) as a new list, and whether
// every param has one. Plain tensors' grads are read in C++; any other object's through Python.
PyObject* grads_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 1)) return nullptr;
  PyObject* params = args[0];
  if (!is_seq(params)) {
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
  return Py_BuildValue("(NO)", grads, every ? Py_True : Py_False);
}

// set_each(dicts, key, value) -> None: dicts[i][key] = value for every i (each a dict): a step count written
// into every param's state record in one call.
PyObject* set_each(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 3)) return nullptr;
  PyObject *dicts = args[0], *key = args[1], *value = args[2];
  if (!is_seq(dicts)) {
    PyErr_SetString(PyExc_TypeError, "set_each expects a list or tuple of dicts");
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(dicts);
  PyObject** ds = PySequence_Fast_ITEMS(dicts);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int rc = PyDict_CheckExact(ds[i]) ? PyDict_SetItem(ds[i], key, value) : PyObject_SetItem(ds[i], key, value);
    if (rc != 0) return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"grads_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_match)), METH_FASTCALL,
     "grads_match(params, grads) -> bool"},
    {"meta_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(meta_match)), METH_FASTCALL,
     "meta_match(tensors, planned) -> bool"},
    {"ptrs_equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ptrs_equal)), METH_FASTCALL,
     "ptrs_equal(tensors, ptrs[, nested]) -> bool"},
    {"same_objects", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(same_objects)), METH_FASTCALL,
     "same_objects(objs, packed) -> bool"},
    {"grads_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_of)), METH_FASTCALL,
     "grads_of(params) -> (grads, every)"},
    {"set_each", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_each)), METH_FASTCALL,
     "set_each(dicts, key, value) -> None"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host_checks_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__host_checks_native(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && PyModule_AddStringConstant(m, "torch_version", BNBF_TORCH_VERSION) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
