// The plan's per-step checks over whole lists of tensors, one C++ call each (bnbf/_host_checks.py holds their
// pure-Python twins, which serve where this extension was not built and are its test oracle).
//
// Built at install time by torch's own tooling (setup.py, torch.utils.cpp_extension), never at run time.
// Every function answers a yes/no question and never raises for unexpected input: "no" sends the caller down
// the slow path, which names what is wrong.

#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <vector>

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

// Whether each grad is a plain, dense, contiguous tensor with its param's shape, dtype and device, whose memory
// holds its values (no negative bit, not an efficient zero tensor) (params: a
// plan's checked params); with `want` (n_want native uint64), *moved tells whether the grads' addresses differ.
bool grads_fit(PyObject* params, PyObject* grads, const uint64_t* want, Py_ssize_t n_want, bool* moved) {
  if (!is_seq(params) || !is_seq(grads)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(params);
  if (PySequence_Fast_GET_SIZE(grads) != n) return false;
  PyObject** ps = PySequence_Fast_ITEMS(params);
  PyObject** gs = PySequence_Fast_ITEMS(grads);
  bool differs = n_want != n;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* p = plain_tensor(ps[i]);
    const at::Tensor* g = plain_tensor(gs[i]);
    if (p == nullptr || g == nullptr) return false;
    if (g->layout() != c10::kStrided || g->scalar_type() != p->scalar_type() || g->device() != p->device() ||
        g->sizes() != p->sizes() || !g->is_contiguous() || g->is_neg() || g->_is_zerotensor()) {
      return false;
    }
    if (want != nullptr && !differs) differs = reinterpret_cast<uintptr_t>(g->const_data_ptr()) != want[i];
  }
  if (moved != nullptr) *moved = differs;
  return true;
}

// grads_match(params, grads) -> bool: each grad a plain, dense, contiguous tensor with its param's shape,
// dtype and device (params: a plan's checked params).
PyObject* grads_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  try {
    if (!grads_fit(args[0], args[1], nullptr, 0, nullptr)) Py_RETURN_FALSE;
  } catch (const std::exception&) {  // metadata that cannot be read here: the slow path will tell
    return no();
  }
  Py_RETURN_TRUE;
}

// grads_fit_at(params, grads, packed) -> False, True or bytes: False where grads_match(params, grads) says no;
// else True where the grads' addresses are packed's (native uint64, in order), else their addresses packed so:
// the grads' check and the test of their address table in one pass.
PyObject* grads_fit_at(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 3)) return nullptr;
  if (!PyBytes_Check(args[2])) Py_RETURN_FALSE;
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(args[2]));
  const Py_ssize_t n_want = PyBytes_GET_SIZE(args[2]) / static_cast<Py_ssize_t>(sizeof(uint64_t));
  bool moved = true;
  std::vector<uint64_t> ptrs;
  try {
    if (!grads_fit(args[0], args[1], want, n_want, &moved)) Py_RETURN_FALSE;
    if (!moved) Py_RETURN_TRUE;
    PyObject** gs = PySequence_Fast_ITEMS(args[1]);  // checked: plain tensors
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(args[1]); ++i) {
      ptrs.push_back(reinterpret_cast<uintptr_t>(THPVariable_Unpack(gs[i]).const_data_ptr()));
    }
  } catch (const std::exception&) {
    return no();
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(ptrs.data()), ptrs.size() * sizeof(uint64_t));
}

// meta_match(tensors, planned[, ptrs]) -> bool: each tensor plain, contiguous, with the shape and dtype of its
// planned twin (a meta tensor made when the plan was built): what resize_, t_, set_ or .data = would change; with
// ptrs (native uint64, as ptrs_equal's), also at its planned address, in the same pass.
PyObject* meta_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 && !nargs_is(nargs, 3)) return nullptr;
  PyObject *tensors = args[0], *planned = args[1];
  if (!is_seq(tensors) || !is_seq(planned)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
  if (PySequence_Fast_GET_SIZE(planned) != n) Py_RETURN_FALSE;
  const uint64_t* want = nullptr;
  if (nargs == 3) {
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != n * static_cast<Py_ssize_t>(sizeof(uint64_t))) {
      Py_RETURN_FALSE;
    }
    want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(args[2]));
  }
  PyObject** ts = PySequence_Fast_ITEMS(tensors);
  PyObject** ms = PySequence_Fast_ITEMS(planned);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* t = plain_tensor(ts[i]);
      if (t == nullptr || !THPVariable_CheckExact(ms[i])) Py_RETURN_FALSE;
      const at::Tensor& m = THPVariable_Unpack(ms[i]);
      if (t->scalar_type() != m.scalar_type() || t->sizes() != m.sizes() || !t->is_contiguous()) Py_RETURN_FALSE;
      if (want != nullptr && reinterpret_cast<uintptr_t>(t->const_data_ptr()) != want[i]) Py_RETURN_FALSE;
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

// ptrs_equal(tensors, ptrs) -> bool: tensors[i].data_ptr() == ptrs[i] for all i, ptrs packed as native uint64
// (bytes of array("Q", ...)): no Python int to convert per tensor.
PyObject* ptrs_equal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *tensors = args[0], *ptrs = args[1];
  if (!is_seq(tensors) || !PyBytes_Check(ptrs)) Py_RETURN_FALSE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(ptrs) != n * static_cast<Py_ssize_t>(sizeof(uint64_t))) Py_RETURN_FALSE;
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(ptrs));
  PyObject** ts = PySequence_Fast_ITEMS(tensors);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!ptr_is(ts[i], want[i])) Py_RETURN_FALSE;
    }
  } catch (const std::exception&) {  // e.g. a tensor without storage
    return no();
  }
  Py_RETURN_TRUE;
}

// A state field's planned record in fields_packed's bytes: its address, its dtype and dimension count
// (dtype << 8 | dim), then its sizes, each a native uint64.
void put_field(const at::Tensor& t, std::vector<uint64_t>& out) {
  out.push_back(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
  out.push_back(static_cast<uint64_t>(t.scalar_type()) << 8 | static_cast<uint64_t>(t.dim()));
  for (const int64_t size : t.sizes()) out.push_back(static_cast<uint64_t>(size));
}

// Whether field t matches its record at want[k] (n words in all), moving k past it.
bool field_is(const at::Tensor& t, const uint64_t* want, Py_ssize_t n, Py_ssize_t& k) {
  const auto sizes = t.sizes();
  const auto dim = static_cast<Py_ssize_t>(sizes.size());
  if (k + 2 + dim > n || reinterpret_cast<uintptr_t>(t.const_data_ptr()) != want[k] ||
      want[k + 1] != (static_cast<uint64_t>(t.scalar_type()) << 8 | static_cast<uint64_t>(dim))) {
    return false;
  }
  k += 2;
  for (const int64_t size : sizes) {
    if (static_cast<uint64_t>(size) != want[k++]) return false;
  }
  return t.is_contiguous();
}

// fields_packed(states) -> bytes or None: each state's (a tuple of tensors) fields' records, in order (put_field),
// which fields_match compares them with later; None for anything else.
PyObject* fields_packed(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 1)) return nullptr;
  PyObject* states = args[0];
  if (!is_seq(states)) Py_RETURN_NONE;
  PyObject** ss = PySequence_Fast_ITEMS(states);
  std::vector<uint64_t> out;
  try {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(states); ++i) {
      if (!PyTuple_Check(ss[i])) Py_RETURN_NONE;
      for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(ss[i]); ++j) {
        PyObject* obj = PyTuple_GET_ITEM(ss[i], j);
        if (!THPVariable_CheckExact(obj) && !THPVariable_Check(obj)) Py_RETURN_NONE;
        put_field(THPVariable_Unpack(obj), out);
      }
    }
  } catch (const std::exception&) {  // e.g. a tensor without storage
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(uint64_t));
}

// fields_match(states, packed) -> bool: each state's fields, in order, at their planned addresses with their planned
// dtypes and sizes (packed: from fields_packed), contiguous. resize_, as_strided_, set_ and t_ change a field's
// shape or strides and keep its address, and the kernels would step it at its planned size and layout.
PyObject* fields_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *states = args[0], *packed = args[1];
  if (!is_seq(states) || !PyBytes_Check(packed)) Py_RETURN_FALSE;
  const Py_ssize_t n = PyBytes_GET_SIZE(packed) / static_cast<Py_ssize_t>(sizeof(uint64_t));
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(packed));
  PyObject** ss = PySequence_Fast_ITEMS(states);
  try {
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(states); ++i) {
      if (!PyTuple_Check(ss[i])) Py_RETURN_FALSE;
      for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(ss[i]); ++j) {
        PyObject* obj = PyTuple_GET_ITEM(ss[i], j);
        if (!THPVariable_CheckExact(obj) && !THPVariable_Check(obj)) Py_RETURN_FALSE;
        if (!field_is(THPVariable_Unpack(obj), want, n, k)) Py_RETURN_FALSE;
      }
    }
    if (k != n) Py_RETURN_FALSE;
  } catch (const std::exception&) {  // e.g. a tensor without storage
    return no();
  }
  Py_RETURN_TRUE;
}

// leaves_fit(params, grads, states, packed, grad_mode) -> bool: a pure step's inputs exactly as an earlier pure
// step made them (its outputs, recorded by fields_packed([tuple(params), *states])): the params plain, each param
// and state field at its recorded address with its dtype and sizes, contiguous, its memory its values (no negative
// bit, not an efficient zero tensor); the grads as grads_match wants them; under grad mode (grad_mode true) none of
// the three requiring grad. What the full checks would establish of such inputs, in one pass.
PyObject* leaves_fit(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 5)) return nullptr;
  PyObject *params = args[0], *grads = args[1], *states = args[2], *packed = args[3];
  const bool grad_mode = args[4] == Py_True;
  if (!is_seq(states) || !PyBytes_Check(packed)) Py_RETURN_FALSE;
  const Py_ssize_t n = PyBytes_GET_SIZE(packed) / static_cast<Py_ssize_t>(sizeof(uint64_t));
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(packed));
  Py_ssize_t k = 0;
  const auto fits = [&](const at::Tensor& t) {
    return field_is(t, want, n, k) && !t.is_neg() && !t._is_zerotensor() && !(grad_mode && t.requires_grad());
  };
  try {
    if (!grads_fit(params, grads, nullptr, 0, nullptr)) Py_RETURN_FALSE;  // also: the params plain tensors
    PyObject** ps = PySequence_Fast_ITEMS(params);
    PyObject** gs = PySequence_Fast_ITEMS(grads);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(params); ++i) {
      if (!fits(THPVariable_Unpack(ps[i])) || (grad_mode && THPVariable_Unpack(gs[i]).requires_grad())) {
        Py_RETURN_FALSE;
      }
    }
    PyObject** ss = PySequence_Fast_ITEMS(states);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(states); ++i) {
      if (!PyTuple_Check(ss[i])) Py_RETURN_FALSE;
      for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(ss[i]); ++j) {
        PyObject* obj = PyTuple_GET_ITEM(ss[i], j);
        if ((!THPVariable_CheckExact(obj) && !THPVariable_Check(obj)) || !fits(THPVariable_Unpack(obj))) {
          Py_RETURN_FALSE;
        }
      }
    }
    if (k != n) Py_RETURN_FALSE;
  } catch (const std::exception&) {
    return no();
  }
  Py_RETURN_TRUE;
}

// grad_table(seqs, out) -> (packed, aligned) or None: the data pointers of seqs[k]'s tensors written into `out`
// (a contiguous int64 CPU tensor, pinned for an upload), seq k from the first even row after seq k - 1's rows
// (each seq's rows start 16-byte aligned, a view the kernel takes as its own table), zeros between; `packed`
// the pointers without the padding (native uint64, in order), `aligned` per seq whether every pointer is
// 16-byte aligned. None, `out` untouched, for anything else (the caller's
// Python twin then answers, or names the problem).
PyObject* grad_table(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *seqs = args[0], *out_obj = args[1];
  const at::Tensor* out = plain_tensor(out_obj);
  if (!is_seq(seqs) || out == nullptr) Py_RETURN_NONE;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs);
  PyObject** ss = PySequence_Fast_ITEMS(seqs);
  std::vector<uint64_t> ptrs;
  std::vector<Py_ssize_t> ends;  // one past each seq's last pointer in ptrs
  Py_ssize_t rows = 0;
  try {
    if (out->scalar_type() != c10::kLong || out->device().type() != c10::DeviceType::CPU || !out->is_contiguous()) {
      Py_RETURN_NONE;
    }
    for (Py_ssize_t k = 0; k < n; ++k) {
      if (!is_seq(ss[k])) Py_RETURN_NONE;
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(ss[k]);
      PyObject** ts = PySequence_Fast_ITEMS(ss[k]);
      rows += rows % 2;
      for (Py_ssize_t i = 0; i < m; ++i) {
        const at::Tensor* t = plain_tensor(ts[i]);
        if (t == nullptr) Py_RETURN_NONE;
        ptrs.push_back(reinterpret_cast<uintptr_t>(t->const_data_ptr()));
      }
      rows += m;
      ends.push_back(static_cast<Py_ssize_t>(ptrs.size()));
    }
    if (out->numel() != rows) Py_RETURN_NONE;
  } catch (const std::exception&) {  // e.g. a tensor without storage
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  auto* dst = static_cast<int64_t*>(out->data_ptr());
  PyObject* aligned = PyTuple_New(n);
  if (aligned == nullptr) return nullptr;
  Py_ssize_t row = 0, start = 0;
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (row % 2) dst[row++] = 0;
    uint64_t any = 0;
    for (Py_ssize_t i = start; i < ends[k]; ++i) {
      dst[row++] = static_cast<int64_t>(ptrs[i]);
      any |= ptrs[i];
    }
    start = ends[k];
    PyObject* flag = any % 16 == 0 ? Py_True : Py_False;
    Py_INCREF(flag);
    PyTuple_SET_ITEM(aligned, k, flag);  // steals the reference
  }
  PyObject* packed =
      PyBytes_FromStringAndSize(reinterpret_cast<const char*>(ptrs.data()), ptrs.size() * sizeof(uint64_t));
  if (packed == nullptr) {
    Py_DECREF(aligned);
    return nullptr;
  }
  return Py_BuildValue("(NN)", packed, aligned);
}

// same_objects(objs, packed) or same_objects(objs, more, packed) -> bool: objs[i] (then more[i]) is the object
// whose address and type address are packed[2i] and packed[2i + 1] (native uint64): the very objects a cached plan
// was built for, while none of them was freed.
PyObject* same_objects(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 && !nargs_is(nargs, 3)) return nullptr;
  PyObject* packed = args[nargs - 1];
  if (!PyBytes_Check(packed)) Py_RETURN_FALSE;
  Py_ssize_t total = 0;
  for (Py_ssize_t k = 0; k + 1 < nargs; ++k) {
    if (!is_seq(args[k])) Py_RETURN_FALSE;
    total += PySequence_Fast_GET_SIZE(args[k]);
  }
  if (PyBytes_GET_SIZE(packed) != 2 * total * static_cast<Py_ssize_t>(sizeof(uint64_t))) Py_RETURN_FALSE;
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(packed));
  for (Py_ssize_t k = 0; k + 1 < nargs; ++k) {
    PyObject** os = PySequence_Fast_ITEMS(args[k]);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(args[k]); ++i, want += 2) {
      if (reinterpret_cast<uintptr_t>(os[i]) != want[0] || reinterpret_cast<uintptr_t>(Py_TYPE(os[i])) != want[1]) {
        Py_RETURN_FALSE;
      }
    }
  }
  Py_RETURN_TRUE;
}

// Whether number `v` is `want` exactly: the same type (bool, int and float apart), a float's bits (a zero's sign
// included), a tuple's items alike (one level: betas).
bool same_number(PyObject* v, PyObject* want, bool in_tuple = false) {
  if (Py_TYPE(v) != Py_TYPE(want)) return false;
  if (PyFloat_CheckExact(v)) {
    double a = PyFloat_AS_DOUBLE(v), b = PyFloat_AS_DOUBLE(want);
    return std::memcmp(&a, &b, sizeof a) == 0;
  }
  if (PyBool_Check(v)) return v == want;
  if (PyLong_CheckExact(v)) return PyObject_RichCompareBool(v, want, Py_EQ) == 1;  // an exact int runs no Python
  if (PyTuple_CheckExact(v) && !in_tuple) {
    Py_ssize_t n = PyTuple_GET_SIZE(v);
    if (n != PyTuple_GET_SIZE(want)) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!same_number(PyTuple_GET_ITEM(v, i), PyTuple_GET_ITEM(want, i), true)) return false;
    }
    return true;
  }
  return false;
}

// same_plain_dicts(dicts, wants) -> bool: dicts[i] is a dict (exactly) with wants[i]'s keys in its order (the same
// objects or equal strings) and its values exactly (same_number): a kept partition's hyperparameters given again
// as new dicts with the same numbers.
PyObject* same_plain_dicts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  if (!is_seq(args[0]) || !is_seq(args[1])) Py_RETURN_FALSE;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
  if (n != PySequence_Fast_GET_SIZE(args[1])) Py_RETURN_FALSE;
  PyObject** dicts = PySequence_Fast_ITEMS(args[0]);
  PyObject** wants = PySequence_Fast_ITEMS(args[1]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *d = dicts[i], *w = wants[i];
    if (!PyDict_CheckExact(d) || !PyDict_CheckExact(w) || PyDict_GET_SIZE(d) != PyDict_GET_SIZE(w)) Py_RETURN_FALSE;
    Py_ssize_t pd = 0, pw = 0;
    PyObject *kd, *vd, *kw, *vw;
    while (PyDict_Next(d, &pd, &kd, &vd) && PyDict_Next(w, &pw, &kw, &vw)) {
      if (kd != kw && !(PyUnicode_CheckExact(kd) && PyUnicode_CheckExact(kw) && PyUnicode_Compare(kd, kw) == 0)) {
        Py_RETURN_FALSE;
      }
      if (!same_number(vd, vw)) Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// values_if_keys(tree, keys) -> list or None: a new list of tree's values where tree is a dict (exactly) whose
// keys are `keys` (a tuple) in order, else None (not such a dict, or keys other than strings that are not the
// very objects of `keys`): a plan's dict of grads taken without building its key tuple.
PyObject* values_if_keys(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *tree = args[0], *keys = args[1];
  if (!PyDict_CheckExact(tree) || !PyTuple_Check(keys) || PyDict_GET_SIZE(tree) != PyTuple_GET_SIZE(keys)) {
    Py_RETURN_NONE;
  }
  PyObject* values = PyList_New(PyTuple_GET_SIZE(keys));
  if (values == nullptr) return nullptr;
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;
  while (PyDict_Next(tree, &pos, &key, &value)) {
    PyObject* want = PyTuple_GET_ITEM(keys, i);
    // the same key objects, usually; else equal strings (other keys: None, the caller compares them in Python,
    // whose __eq__ could change the dict under this walk)
    if (key != want &&
        !(PyUnicode_CheckExact(key) && PyUnicode_CheckExact(want) && PyUnicode_Compare(key, want) == 0)) {
      Py_DECREF(values);
      Py_RETURN_NONE;
    }
    Py_INCREF(value);
    PyList_SET_ITEM(values, i++, value);  // steals the reference
  }
  return values;
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

// own_grads_at(params, packed) -> None, True or (grads, bytes): grads_fit_at of the params' own .grad in one call
// (an adapter stepping its params' grads, bnbf_nn): None where some param has no grad or one grads_fit refuses
// (the caller's general path then names it), True where every grad is at packed's address (native uint64, in
// order), else the grads as a new list and their addresses packed so.
PyObject* own_grads_at(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  PyObject *params = args[0], *packed = args[1];
  if (!is_seq(params) || !PyBytes_Check(packed)) Py_RETURN_NONE;
  PyObject* read = grads_of(nullptr, args, 1);  // (grads, every)
  if (read == nullptr) return nullptr;
  PyObject* grads = PyTuple_GET_ITEM(read, 0);
  const auto* want = reinterpret_cast<const uint64_t*>(PyBytes_AS_STRING(packed));
  const Py_ssize_t n_want = PyBytes_GET_SIZE(packed) / static_cast<Py_ssize_t>(sizeof(uint64_t));
  bool moved = true;
  std::vector<uint64_t> ptrs;
  try {
    if (PyTuple_GET_ITEM(read, 1) != Py_True || !grads_fit(params, grads, want, n_want, &moved)) {
      Py_DECREF(read);
      Py_RETURN_NONE;
    }
    if (!moved) {
      Py_DECREF(read);
      Py_RETURN_TRUE;
    }
    PyObject** gs = PySequence_Fast_ITEMS(grads);  // checked: plain tensors
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(grads); ++i) {
      ptrs.push_back(reinterpret_cast<uintptr_t>(THPVariable_Unpack(gs[i]).const_data_ptr()));
    }
  } catch (const std::exception&) {  // metadata that cannot be read here: the general path will tell
    PyErr_Clear();
    Py_DECREF(read);
    Py_RETURN_NONE;
  }
  const auto size = static_cast<Py_ssize_t>(ptrs.size() * sizeof(uint64_t));
  PyObject* bytes = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(ptrs.data()), size);
  if (bytes == nullptr) {
    Py_DECREF(read);
    return nullptr;
  }
  Py_INCREF(grads);
  Py_DECREF(read);
  return Py_BuildValue("(NN)", grads, bytes);
}

// set_each(dicts, key, value) -> None: dicts[i][key] = value for every i (each a dict): a step count written
// into every param's state record in one call, past a dict subclass's __setitem__ (bnbf_nn's records guard
// only bitsandbytes' views with theirs, never the step).
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
    const int rc = PyDict_Check(ds[i]) ? PyDict_SetItem(ds[i], key, value) : PyObject_SetItem(ds[i], key, value);
    if (rc != 0) return nullptr;
  }
  Py_RETURN_NONE;
}

// visit: one value of a node for walk_node (1 yes, 0 no, -1 a Python error set), held while it is read: an
// isinstance of a non-exact type may run Python code (a __class__ property) that edits the tree under the walk.
int walk_node(PyObject* tree, PyObject* leaf_type, PyObject* leaves, PyObject* shape);

int visit(PyObject* v, PyObject* leaf_type, PyObject* leaves, PyObject* shape) {
  Py_INCREF(v);
  int result = 1;
  if (PyDict_CheckExact(v) || PyList_CheckExact(v) || PyTuple_CheckExact(v) || PyODict_CheckExact(v)) {
    result = walk_node(v, leaf_type, leaves, shape);
  } else if (!Py_IS_TYPE(v, reinterpret_cast<PyTypeObject*>(leaf_type)) && PyObject_IsInstance(v, leaf_type) != 1) {
    PyErr_Clear();  // another type, or an isinstance that raised: a "no"
    result = 0;
  } else if (PyList_Append(leaves, v) < 0 || PyList_Append(shape, Py_None) < 0) {
    result = -1;
  }
  Py_DECREF(v);
  return result;
}

// walk_node: _host_checks._walk's answer for one dict, OrderedDict, list or tuple (exact types, never a leaf:
// leaf_type is Tensor or State): 1 yes, 0 no, -1 a Python error set (an append out of memory). A tree too
// deep for the interpreter's recursion limit is a "no" (pytree's walk then answers for it, as for the twin).
int walk_node(PyObject* tree, PyObject* leaf_type, PyObject* leaves, PyObject* shape) {
  if (Py_EnterRecursiveCall(" while walking a tree")) {
    PyErr_Clear();
    return 0;
  }
  int result = 1;
  PyObject* size = nullptr;
  if (PyDict_CheckExact(tree)) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (result == 1 && PyDict_Next(tree, &pos, &key, &value)) result = PyUnicode_CheckExact(key);
    size = PyLong_FromSsize_t(PyDict_GET_SIZE(tree));
    if (result == 1 && (size == nullptr || PyList_Append(shape, reinterpret_cast<PyObject*>(&PyDict_Type)) < 0 ||
                        PyList_Append(shape, size) < 0)) {
      result = -1;
    }
    for (pos = 0; result == 1 && PyDict_Next(tree, &pos, &key, &value);) {
      if (PyList_Append(shape, key) < 0) result = -1;
    }
    for (pos = 0; result == 1 && PyDict_Next(tree, &pos, &key, &value);) {
      result = visit(value, leaf_type, leaves, shape);
    }
    // a node resized by Python code under the walk (its shape no longer its leaves' count): a "no"
    if (result == 1 && PyDict_GET_SIZE(tree) != PyLong_AsSsize_t(size)) result = 0;
  } else if (PyODict_CheckExact(tree)) {  // its own order (move_to_end), not its dict's: by its keys
    const Py_ssize_t n = PyODict_SIZE(tree);
    PyObject* keys = PyMapping_Keys(tree);  // a new list in the OrderedDict's order (its C keys view)
    size = PyLong_FromSsize_t(n);
    if (keys == nullptr || size == nullptr) {
      result = -1;
    } else if (PyList_GET_SIZE(keys) != n) {
      result = 0;
    }
    for (Py_ssize_t i = 0; result == 1 && i < n; ++i) result = PyUnicode_CheckExact(PyList_GET_ITEM(keys, i));
    if (result == 1 && (PyList_Append(shape, reinterpret_cast<PyObject*>(&PyODict_Type)) < 0 ||
                        PyList_Append(shape, size) < 0)) {
      result = -1;
    }
    for (Py_ssize_t i = 0; result == 1 && i < n; ++i) {
      if (PyList_Append(shape, PyList_GET_ITEM(keys, i)) < 0) result = -1;
    }
    for (Py_ssize_t i = 0; result == 1 && i < n; ++i) {
      PyObject* value = PyDict_GetItemWithError(tree, PyList_GET_ITEM(keys, i));  // its items are its dict's
      result = value != nullptr ? visit(value, leaf_type, leaves, shape) : PyErr_Occurred() ? -1 : 0;
    }
    Py_XDECREF(keys);
    if (result == 1 && PyODict_SIZE(tree) != n) result = 0;
  } else {
    const Py_ssize_t n = PyList_CheckExact(tree) ? PyList_GET_SIZE(tree) : PyTuple_GET_SIZE(tree);
    size = PyLong_FromSsize_t(n);
    if (size == nullptr || PyList_Append(shape, reinterpret_cast<PyObject*>(Py_TYPE(tree))) < 0 ||
        PyList_Append(shape, size) < 0) {
      result = -1;
    }
    // by index: a list edited by Python code under the walk is read at its current length
    for (Py_ssize_t i = 0; result == 1 && i < Py_SIZE(tree); ++i) {
      result = visit(PyList_CheckExact(tree) ? PyList_GET_ITEM(tree, i) : PyTuple_GET_ITEM(tree, i), leaf_type,
                     leaves, shape);
    }
    if (result == 1 && Py_SIZE(tree) != n) result = 0;
  }
  Py_XDECREF(size);
  Py_LeaveRecursiveCall();
  return result;
}

// walk(tree, leaf_type, leaves, shape) -> bool: _host_checks._walk (its Python twin) in one call: appends tree's
// leaves and structure to the two lists, True where tree is dicts and OrderedDicts (str keys), lists and tuples of
// leaf_type's instances only, else False (the lists then hold a part: the caller drops them).
PyObject* walk(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 4)) return nullptr;
  PyObject *tree = args[0], *leaf_type = args[1], *leaves = args[2], *shape = args[3];
  if (!PyList_CheckExact(leaves) || !PyList_CheckExact(shape)) {
    PyErr_SetString(PyExc_TypeError, "walk expects two lists to append to");
    return nullptr;
  }
  if (!(PyDict_CheckExact(tree) || PyList_CheckExact(tree) || PyTuple_CheckExact(tree) || PyODict_CheckExact(tree))) {
    Py_RETURN_FALSE;
  }
  const int result = walk_node(tree, leaf_type, leaves, shape);
  if (result < 0) return nullptr;
  return PyBool_FromLong(result);
}

// unwalk_node: the tree at shape[*pos] (a new reference), leaves taken from leaves[*leaf] on; nullptr with an
// error set where the shape or the leaves run short or an entry is not walk's (a shape is walk's own, but a
// malformed one must not read past the end).
PyObject* unwalk_node(PyObject* shape, Py_ssize_t* pos, PyObject* leaves, Py_ssize_t* leaf) {
  const Py_ssize_t n_shape = PyTuple_GET_SIZE(shape);
  if (*pos >= n_shape) return PyErr_Format(PyExc_ValueError, "unwalk: the shape ends at entry %zd", *pos);
  PyObject* t = PyTuple_GET_ITEM(shape, (*pos)++);
  if (t == Py_None) {
    if (*leaf >= PyList_GET_SIZE(leaves)) return PyErr_Format(PyExc_ValueError, "unwalk: %zd leaves", *leaf);
    PyObject* v = PyList_GET_ITEM(leaves, (*leaf)++);
    Py_INCREF(v);
    return v;
  }
  const bool is_odict = t == reinterpret_cast<PyObject*>(&PyODict_Type);
  const bool is_dict = is_odict || t == reinterpret_cast<PyObject*>(&PyDict_Type);
  if (!(is_dict || t == reinterpret_cast<PyObject*>(&PyList_Type) || t == reinterpret_cast<PyObject*>(&PyTuple_Type)) ||
      *pos >= n_shape || !PyLong_CheckExact(PyTuple_GET_ITEM(shape, *pos))) {
    return PyErr_Format(PyExc_ValueError, "unwalk: entry %zd of the shape is not walk's", *pos - 1);
  }
  const Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, (*pos)++));
  if (n < 0 || n > n_shape - *pos) {  // every item takes an entry at least
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "unwalk: entry %zd of the shape is not walk's", *pos - 1);
    return nullptr;
  }
  if (Py_EnterRecursiveCall(" while rebuilding a tree")) return nullptr;
  PyObject* out = nullptr;
  if (is_dict) {
    const Py_ssize_t keys = *pos;
    *pos += n;
    out = is_odict ? PyODict_New() : PyDict_New();
    for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
      PyObject* v = unwalk_node(shape, pos, leaves, leaf);
      PyObject* key = PyTuple_GET_ITEM(shape, keys + i);
      if (v == nullptr || (is_odict ? PyODict_SetItem(out, key, v) : PyDict_SetItem(out, key, v)) < 0) Py_CLEAR(out);
      Py_XDECREF(v);
    }
  } else {
    out = t == reinterpret_cast<PyObject*>(&PyList_Type) ? PyList_New(n) : PyTuple_New(n);
    for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
      PyObject* v = unwalk_node(shape, pos, leaves, leaf);
      if (v == nullptr) {
        Py_CLEAR(out);
      } else if (PyList_CheckExact(out)) {
        PyList_SET_ITEM(out, i, v);  // steals v
      } else {
        PyTuple_SET_ITEM(out, i, v);
      }
    }
  }
  Py_LeaveRecursiveCall();
  return out;
}

// unwalk(shape, leaves) -> tree: _host_checks._unwalk (its Python twin) in one call: the tree of walk's `shape`
// (a tuple) with `leaves` (a list) in it, each used once in order.
PyObject* unwalk(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 2)) return nullptr;
  if (!PyTuple_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "unwalk expects a shape tuple and a list of leaves");
    return nullptr;
  }
  Py_ssize_t pos = 0, leaf = 0;
  PyObject* out = unwalk_node(args[0], &pos, args[1], &leaf);
  if (out != nullptr && (pos != PyTuple_GET_SIZE(args[0]) || leaf != PyList_GET_SIZE(args[1]))) {
    Py_DECREF(out);
    return PyErr_Format(PyExc_ValueError, "unwalk: %zd of %zd shape entries and %zd of %zd leaves used", pos,
                        PyTuple_GET_SIZE(args[0]), leaf, PyList_GET_SIZE(args[1]));
  }
  return out;
}

PyMethodDef methods[] = {
    {"grads_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_match)), METH_FASTCALL,
     "grads_match(params, grads) -> bool"},
    {"grads_fit_at", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_fit_at)), METH_FASTCALL,
     "grads_fit_at(params, grads, packed) -> False, True or bytes"},
    {"meta_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(meta_match)), METH_FASTCALL,
     "meta_match(tensors, planned[, ptrs]) -> bool"},
    {"ptrs_equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ptrs_equal)), METH_FASTCALL,
     "ptrs_equal(tensors, ptrs) -> bool"},
    {"fields_packed", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fields_packed)), METH_FASTCALL,
     "fields_packed(states) -> bytes or None"},
    {"fields_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fields_match)), METH_FASTCALL,
     "fields_match(states, packed) -> bool"},
    {"leaves_fit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(leaves_fit)), METH_FASTCALL,
     "leaves_fit(params, grads, states, packed, grad_mode) -> bool"},
    {"grad_table", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grad_table)), METH_FASTCALL,
     "grad_table(seqs, out) -> (packed, aligned) or None"},
    {"same_objects", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(same_objects)), METH_FASTCALL,
     "same_objects(objs[, more], packed) -> bool"},
    {"same_plain_dicts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(same_plain_dicts)),
     METH_FASTCALL, "same_plain_dicts(dicts, wants) -> bool"},
    {"values_if_keys", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(values_if_keys)), METH_FASTCALL,
     "values_if_keys(tree, keys) -> list or None"},
    {"grads_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(grads_of)), METH_FASTCALL,
     "grads_of(params) -> (grads, every)"},
    {"own_grads_at", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(own_grads_at)), METH_FASTCALL,
     "own_grads_at(params, packed) -> None, True or (grads, bytes)"},
    {"set_each", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(set_each)), METH_FASTCALL,
     "set_each(dicts, key, value) -> None"},
    {"walk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(walk)), METH_FASTCALL,
     "walk(tree, leaf_type, leaves, shape) -> bool"},
    {"unwalk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unwalk)), METH_FASTCALL,
     "unwalk(shape, leaves) -> tree"},
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
