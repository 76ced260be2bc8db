// Python face of the NVMe I/O engine (csrc/aio): tensors in, raw pointers and sizes to the
// torch-free engine. IoError becomes the OSError subclass its errno calls for
// (FileNotFoundError, IsADirectoryError, PermissionError, ...) with `filename` set; option
// errors become ValueError.
#include <torch/extension.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "aio/aligned_buffer.h"
#include "binding_dtype.h"
#include "aio/io_engine.h"
#include "aio/io_error.h"

namespace py = pybind11;
using zc::aio::Backend;
using zc::aio::DirectMode;
using zc::aio::Engine;
using zc::aio::EngineOptions;
using zc::aio::SubmitInfo;

namespace {

Backend parse_backend(const std::string& s) {
  if (s == "libaio") return Backend::LibAio;
  if (s == "io_uring") return Backend::IoUring;
  if (s == "threadpool") return Backend::ThreadPool;
  throw std::invalid_argument("backend must be 'libaio', 'io_uring' or 'threadpool', got '" + s + "'");
}

DirectMode parse_direct(const std::string& s) {
  if (s == "auto") return DirectMode::Auto;
  if (s == "require") return DirectMode::Require;
  if (s == "off") return DirectMode::Off;
  throw std::invalid_argument("direct must be 'auto', 'require' or 'off', got '" + s + "'");
}

void check_tensor(const at::Tensor& t, const char* op) {
  ZC_CHECK_VALUE(t.device().is_cpu(), op, ": 'tensor' is on ", t.device(),
                    "; AsyncIO moves CPU tensors (copy it into a buffer from aligned_pinned_empty first)");
  ZC_CHECK_VALUE(t.is_contiguous(), op, ": 'tensor' must be contiguous (call .contiguous())");
  ZC_CHECK_VALUE(t.numel() == 0 || t.data_ptr() != nullptr, op, ": 'tensor' has no storage");
}

uint64_t nbytes(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

py::tuple info_tuple(const SubmitInfo& i) { return py::make_tuple(i.direct, i.bounced); }

// Raised with the GIL held: OSError(errno, message, filename), which Python turns into the
// errno's subclass (FileNotFoundError, ...). Without an errno (a file shorter than the request,
// a short transfer) a plain OSError whose message names the file.
void raise_os_error(const zc::aio::IoError& e) {
  PyObject* exc = nullptr;
  if (e.err() != 0) {
    PyObject* name = e.path().empty() ? (Py_INCREF(Py_None), Py_None) : PyUnicode_DecodeFSDefault(e.path().c_str());
    if (name) exc = PyObject_CallFunction(PyExc_OSError, "isN", e.err(), e.detail().c_str(), name);
  } else {
    exc = PyObject_CallFunction(PyExc_OSError, "s", e.what());
  }
  if (!exc) return;  // building it failed and set that error instead
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
}

// Calls f with the GIL released and rethrows its exception with the GIL held.
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  std::exception_ptr err;
  using R = decltype(f());
  if constexpr (std::is_void_v<R>) {
    {
      py::gil_scoped_release nogil;
      try {
        f();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
  } else {
    R out{};
    {
      py::gil_scoped_release nogil;
      try {
        out = f();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return out;
  }
}

// A page-aligned, mlock'ed (best effort) uint8 tensor of `nbytes` bytes; the memory is
// unmapped when the tensor's storage dies.
py::tuple alloc_aligned(int64_t nbytes, bool lock) {
  ZC_CHECK_VALUE(nbytes >= 0, "aligned_pinned_empty: size must be >= 0 bytes, got ", nbytes);
  bool locked = false;
  uint64_t cap = 0;
  void* p = zc::aio::alloc_aligned(static_cast<uint64_t>(nbytes), lock, &locked, &cap);
  at::Tensor t = torch::from_blob(
      p, {nbytes}, [cap](void* q) { zc::aio::free_aligned(q, cap); }, torch::dtype(torch::kUInt8));
  return py::make_tuple(t, locked);
}

}  // namespace

void register_aio(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const zc::aio::IoError& e) {
      raise_os_error(e);
    }
  });

  py::class_<Engine>(m, "AioEngine", "NVMe I/O engine (use zerocore.ops.AsyncIO)")
      .def(py::init([](int64_t block_size, int64_t queue_depth, int64_t threads, const std::string& backend,
                       bool single_submit, bool overlap_events, const std::string& direct) {
             ZC_CHECK_VALUE(block_size > 0, "block_size must be positive, got ", block_size);
             ZC_CHECK_VALUE(queue_depth > 0 && queue_depth <= 4096, "queue_depth must be between 1 and 4096, got ",
                               queue_depth);
             ZC_CHECK_VALUE(threads > 0 && threads <= 1024, "threads must be between 1 and 1024, got ", threads);
             EngineOptions o;
             o.block_size = static_cast<uint64_t>(block_size);
             o.queue_depth = static_cast<int>(queue_depth);
             o.threads = static_cast<int>(threads);
             o.backend = parse_backend(backend);
             o.single_submit = single_submit;
             o.overlap_events = overlap_events;
             o.direct = parse_direct(direct);
             return std::make_unique<Engine>(o);
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"), py::arg("backend"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("direct"))
      .def(
          "submit",
          [](Engine& e, bool write, const at::Tensor& t, const std::string& path, int64_t offset) {
            check_tensor(t, write ? "async_pwrite" : "async_pread");
            auto keep = std::make_shared<at::Tensor>(t);
            void* ptr = t.numel() ? t.data_ptr() : nullptr;
            const uint64_t n = nbytes(t);
            return info_tuple(without_gil([&] { return e.submit(write, ptr, n, path, offset, keep); }));
          },
          py::arg("write"), py::arg("tensor"), py::arg("path"), py::arg("offset"))
      .def(
          "run",
          [](Engine& e, bool write, const at::Tensor& t, const std::string& path, int64_t offset) {
            check_tensor(t, write ? "sync_pwrite" : "sync_pread");
            void* ptr = t.numel() ? t.data_ptr() : nullptr;
            const uint64_t n = nbytes(t);
            return info_tuple(without_gil([&] { return e.run(write, ptr, n, path, offset); }));
          },
          py::arg("write"), py::arg("tensor"), py::arg("path"), py::arg("offset"))
      .def("wait",
           [](Engine& e) {
             // The tensors kept alive during the transfers are dropped here, with the GIL held.
             std::vector<std::shared_ptr<void>> released;
             std::exception_ptr err;
             int64_t n = 0;
             {
               py::gil_scoped_release nogil;
               try {
                 n = e.wait(&released);
               } catch (...) {
                 err = std::current_exception();
               }
             }
             released.clear();
             if (err) std::rethrow_exception(err);
             return n;
           })
      .def("pending", &Engine::pending)
      .def("_simulate_no_direct", &Engine::set_simulate_no_direct, "tests: act as if O_DIRECT were refused");

  m.def(
      "aio_backends",
      [] {
        py::dict out;
        for (Backend b : zc::aio::kAllBackends) {
          std::string why;
          const bool ok = zc::aio::backend_available(b, &why);
          out[zc::aio::backend_name(b)] = ok ? py::none() : py::object(py::str(why));
        }
        return out;
      },
      "{backend: None if usable here, else the reason}");
  m.def(
      "_aio_threadpool_max_syscall_bytes",
      [](int64_t n) {
        ZC_CHECK_VALUE(n >= 0, "_aio_threadpool_max_syscall_bytes: got ", n);
        zc::aio::testing::threadpool_max_syscall_bytes.store(static_cast<uint64_t>(n));
      },
      "tests: cap every pread/pwrite of the thread-pool backend at n bytes (0: no cap), so each op is a "
      "chain of short transfers");
  m.def("aio_alloc_aligned", &alloc_aligned, py::arg("nbytes"), py::arg("lock") = true,
        "page-aligned, mlock'ed (best effort) uint8 tensor; returns (tensor, locked)");
}
