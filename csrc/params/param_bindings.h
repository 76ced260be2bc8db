// Stage 3's per-unit host work in one native call each, where Python would loop per parameter:
// - set_data: every parameter of a group shown as its view of the gathered buffer (or as the
//   empty tensor once freed), as `p.data = v` does for one;
// - pack_grads: a group's `.grad`s copied into its reduction bucket (gaps zeroed) and dropped;
// - call_before_node: a Python callable run when the autograd node that made a tensor is about to
//   run (what `tensor.register_hook` gives, without building a Python handle per call);
// - make_access_getattr: stage 3's parameter-access `__getattr__`, native.
// Included once, by bindings.cpp (the file that sees torch).
#pragma once

#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "binding_grads.h"
#include "binding_memory.h"

namespace zc_params {

namespace py = pybind11;

void set_data(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& values) {
  TORCH_CHECK_VALUE(params.size() == values.size(), "set_data: ", params.size(), " parameters but ",
                    values.size(), " values");
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(values[i]);
}

// Stage 3's parameter-access hook as a native `__getattr__` (access.py installs it on the modules
// registering partitioned parameters): nn.Module.__getattr__'s parameter lookup, and when the
// parameter is empty (its unit freed) the module's `_zc_gatherer.on_access(p)` first. Native so
// that reading a gathered parameter runs no zerocore Python code at all; every other name goes to
// `fallback` (the class's own __getattr__).
py::object make_access_getattr(py::object fallback) {
  auto getattr = [fallback](py::handle self, py::handle name) -> py::object {
    py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(self.ptr(), nullptr));
    if (!dict) throw py::error_already_set();
    PyObject* params = PyDict_GetItemString(dict.ptr(), "_parameters");  // borrowed
    PyObject* p = params && PyDict_Check(params) ? PyDict_GetItemWithError(params, name.ptr()) : nullptr;
    if (PyErr_Occurred()) throw py::error_already_set();
    if (p == nullptr || p == Py_None || !THPVariable_Check(p)) return fallback(self, name);
    py::object param = py::reinterpret_borrow<py::object>(p);
    if (THPVariable_Unpack(p).numel() == 0) {
      PyObject* g = PyDict_GetItemString(dict.ptr(), "_zc_gatherer");  // borrowed
      if (g != nullptr && g != Py_None) py::reinterpret_borrow<py::object>(g).attr("on_access")(param);
    }
    return param;
  };
  return py::cpp_function(getattr, py::is_method(py::none()));
}

// The group's present `.grad`s into `flat` at their offsets (gaps zeroed), then dropped; false,
// touching nothing, where binding_grads.h's rules refuse them (the caller then packs through the
// checked op, which names what is wrong).
bool pack_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, at::Tensor& flat) {
  TORCH_CHECK_VALUE(params.size() == offsets.size(), "pack_grads: ", params.size(), " parameters but ",
                    offsets.size(), " offsets");
  std::vector<zc_bind::GradPiece> pieces;
  if (!zc_bind::packable_grads(params, offsets, flat, pieces)) return false;
  const int64_t total = flat.numel(), esize = flat.element_size();
  const bool cpu = flat.device().is_cpu();
  auto* base = static_cast<char*>(flat.data_ptr());
  auto zero = [&](int64_t a, int64_t b) {
    if (a >= b) return;
    if (cpu) std::memset(base + a * esize, 0, (b - a) * esize);
    else flat.narrow(0, a, b - a).zero_();
  };
  int64_t end = 0;
  size_t k = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].grad();
    if (!g.defined()) continue;
    const zc_bind::GradPiece& piece = pieces[k++];
    zero(end, piece.offset);
    if (cpu) std::memcpy(base + piece.offset * esize, piece.data, piece.numel * esize);
    else flat.narrow(0, piece.offset, piece.numel).copy_(g.reshape(-1), /*non_blocking=*/true);
    end = piece.offset + piece.numel;
  }
  zero(end, total);
  zc_bind::drop_grads(params);
  return true;
}

// A node pre-hook calling a Python callable with no arguments; the gradients pass unchanged.
struct CallBeforeNode : torch::autograd::FunctionPreHook {
  explicit CallBeforeNode(PyObject* fn) : fn_(fn) { Py_INCREF(fn_); }
  ~CallBeforeNode() override {
    if (Py_IsInitialized()) {  // the graph may be freed without the GIL held
      py::gil_scoped_acquire gil;
      Py_DECREF(fn_);
    }
  }
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    py::gil_scoped_acquire gil;
    PyObject* res = PyObject_CallNoArgs(fn_);
    if (res == nullptr) throw python_error();  // the engine re-raises the Python exception itself
    Py_DECREF(res);
    return grads;
  }

 private:
  PyObject* fn_;
};

// False when `t` was made by no autograd node (a leaf): the caller hooks it another way.
bool call_before_node(const at::Tensor& t, py::object fn) {
  const auto& node = t.grad_fn();
  if (!node) return false;
  node->add_pre_hook(std::make_unique<CallBeforeNode>(fn.ptr()));
  return true;
}

void register_params(py::module_& m) {
  m.def("set_data", &set_data, "params[i].data = values[i] for every i, in one call");
  m.def("make_access_getattr", &make_access_getattr, "a native __getattr__ for stage 3's parameter-access hook");
  m.def("pack_grads", &pack_grads, "params' .grad into a flat buffer at offsets (gaps zeroed), then dropped; "
        "false (nothing done) when a gradient needs the checked path");
  m.def("call_before_node", &call_before_node, "run fn() when the autograd node that made t is about to run");
}

}  // namespace zc_params
