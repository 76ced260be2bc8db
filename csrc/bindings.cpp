// The one file that sees torch: turns tensors into raw pointers and sizes, checks them, and
// calls the kernels. Checks raise ValueError / TypeError naming the argument; kernels that
// reject input throw std::invalid_argument, which pybind11 turns into ValueError.
#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adam/adam.h"
#include "binding_dtype.h"
#include "binding_memory.h"
#include "binding_spans.h"
#include "bench/stream.h"
#include "cast/cast.h"
#include "checksum/crc32c.h"
#include "compiler_info.h"
#include "flatten/flatten.h"
#include "isa/dispatch.h"
#include "norm/norm.h"
#include "params/param_bindings.h"

// Optional parts register their functions from their own binding files: the CUDA binding
// needs ATen's CUDA headers, which a CPU torch does not have, and keeping aio apart keeps
// this file small. Each is compiled only when build_spec says the part is built.
#ifdef ZEROCORE_WITH_AIO
void register_aio(pybind11::module_& m);
#endif
#ifdef ZEROCORE_WITH_CUDA
void register_cuda(pybind11::module_& m);
#endif

namespace {

using zc_bind::to_zc;

void check_cpu_contiguous(const at::Tensor& t, const std::string& op, const std::string& arg) {
  ZC_CHECK_VALUE(t.device().is_cpu(), op, ": '", arg, "' is on ", t.device(),
                    "; this build has CPU kernels only (CUDA kernels are not built into it)");
  ZC_CHECK_VALUE(t.is_contiguous(), op, ": '", arg, "' must be contiguous (call .contiguous())");
  zc_bind::check_memory(t, op, arg);
}

void check_f32(const at::Tensor& t, int64_t numel, const std::string& op, const std::string& arg) {
  check_cpu_contiguous(t, op, arg);
  ZC_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": '", arg, "' must be float32, got ", t.scalar_type());
  ZC_CHECK_VALUE(t.numel() == numel, op, ": '", arg, "' has ", t.numel(), " elements but 'param' has ", numel);
}

// The per-step fast test of an fp32 state tensor (check_f32 formats its messages, so it runs only
// when this fails: these tests run per tensor per step).
bool plain_f32(const at::Tensor& t, int64_t numel) {
  return t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat && t.numel() == numel &&
         zc_bind::holds_memory(t);
}

// `index` < 0 for a single-tensor call; else the position in the list, used only to name
// the argument in an error as the Python checks do ('grad', or 'grads[3]' for a list; names are
// built on failure: this runs per tensor per step).
zc::AdamTensor make_adam_tensor(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                                const at::Tensor& v, const std::optional<at::Tensor>& out,
                                const zc::AdamScalars& s, const char* op, int64_t index) {
  auto name = [index](const char* arg) {
    return index < 0 ? std::string(arg) : std::string(arg) + "s[" + std::to_string(index) + "]";
  };
  const int64_t n = p.numel();
  if (!plain_f32(p, n)) check_f32(p, n, op, name("param"));
  if (!plain_f32(m, n)) check_f32(m, n, op, name("exp_avg"));
  if (!plain_f32(v, n)) check_f32(v, n, op, name("exp_avg_sq"));
  if (!(g.device().is_cpu() && g.is_contiguous() && zc_bind::holds_memory(g)))
    check_cpu_contiguous(g, op, name("grad"));
  const std::optional<zc::DType> known = zc_bind::kernel_dtype(g);
  const zc::DType gdt = known ? *known : to_zc(g, op, name("grad"));
  ZC_CHECK_VALUE(g.numel() == n, op, ": '", name("grad"), "' has ", g.numel(), " elements but '",
                    name("param"), "' has ", n);
  zc::AdamTensor t{p.data_ptr<float>(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(),
                   nullptr, n, gdt, zc::DType::F32, s};
  if (out.has_value()) {
    const at::Tensor& o = *out;
    check_cpu_contiguous(o, op, name("param_out"));
    const zc::DType odt = to_zc(o, op, name("param_out"));
    ZC_CHECK_TYPE(odt != zc::DType::F32, op, ": '", name("param_out"), "' must be bfloat16 or float16, got float32");
    ZC_CHECK_VALUE(o.numel() == n, op, ": '", name("param_out"), "' has ", o.numel(), " elements but '",
                      name("param"), "' has ", n);
    t.param_out = o.data_ptr();
    t.out_dtype = odt;
  }
  return t;
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step, bool adamw,
               double grad_scale) {
  const zc::AdamScalars s = zc::adam_scalars(lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale);
  const zc::AdamTensor t = make_adam_tensor(param, grad, exp_avg, exp_avg_sq, param_out, s, "adam_step", -1);
  zc::adam_step_multi(&t, 1, at::get_num_threads());
}

// One native call for a whole parameter group: per-tensor step counts (torch keeps one per
// parameter), shared hyper-parameters. With `sources` (three lists: master, m, v) the step reads
// the old values there and writes the new ones into params / exp_avgs / exp_avg_sqs (out of place,
// the same bits), leaving the sources as they were.
void adam_step_multi_impl(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::optional<std::vector<at::Tensor>>& param_outs, const std::vector<int64_t>& steps,
                          double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                          double grad_scale, const std::vector<at::Tensor>* sources) {
  const size_t n = params.size();
  ZC_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
                    "adam_step_multi: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  ZC_CHECK_VALUE(!param_outs.has_value() || param_outs->size() == n,
                    "adam_step_multi: param_outs must have one tensor per param");
  ZC_CHECK_VALUE(sources == nullptr || sources->size() == 3 * n,
                    "adam_step_multi: sources must hold a master, an exp_avg and an exp_avg_sq per param");
  std::vector<zc::AdamTensor> ts;
  ts.reserve(n);
  zc_bind::Spans spans((sources ? 8 : 5) * n);
  zc::AdamScalars s{};
  int64_t scalars_step = -1;  // the steps are usually all equal: fold the scalars once per value
  for (size_t i = 0; i < n; ++i) {
    if (steps[i] != scalars_step) {
      s = zc::adam_scalars(lr, beta1, beta2, eps, weight_decay, steps[i], adamw, grad_scale);
      scalars_step = steps[i];
    }
    std::optional<at::Tensor> out;
    if (param_outs.has_value()) out = (*param_outs)[i];
    const auto k = static_cast<int64_t>(i);
    ts.push_back(make_adam_tensor(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out, s, "adam_step_multi", k));
    spans.add(params[i], "params", 0, k);
    spans.add(grads[i], "grads", 1, k);
    spans.add(exp_avgs[i], "exp_avgs", 2, k);
    spans.add(exp_avg_sqs[i], "exp_avg_sqs", 3, k);
    if (out.has_value()) spans.add(*out, "param_outs", 4, k);
    if (sources != nullptr) {
      const int64_t numel = params[i].numel();
      const char* names[3] = {"source params", "source exp_avgs", "source exp_avg_sqs"};
      const float* ptrs[3];
      for (int r = 0; r < 3; ++r) {
        const at::Tensor& src = (*sources)[3 * i + r];
        if (!plain_f32(src, numel))
          check_f32(src, numel, "adam_step_multi", std::string(names[r]) + "[" + std::to_string(i) + "]");
        spans.add(src, names[r], 5 + r, k);
        ptrs[r] = src.data_ptr<float>();
      }
      ts.back().param_src = ptrs[0];
      ts.back().exp_avg_src = ptrs[1];
      ts.back().exp_avg_sq_src = ptrs[2];
    }
  }
  spans.check_disjoint("adam_step_multi");  // before anything is written
  zc::adam_step_multi(ts.data(), static_cast<int64_t>(n), at::get_num_threads());
}

void adam_step_multi(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::optional<std::vector<at::Tensor>>& param_outs, const std::vector<int64_t>& steps, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool adamw, double grad_scale) {
  adam_step_multi_impl(params, grads, exp_avgs, exp_avg_sqs, param_outs, steps, lr, beta1, beta2, eps, weight_decay,
                       adamw, grad_scale, nullptr);
}

void adam_step_multi_from(const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                          const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::optional<std::vector<at::Tensor>>& param_outs, const std::vector<int64_t>& steps,
                          double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                          double grad_scale) {
  adam_step_multi_impl(params, grads, exp_avgs, exp_avg_sqs, param_outs, steps, lr, beta1, beta2, eps, weight_decay,
                       adamw, grad_scale, &sources);
}

std::vector<zc::Segment> segments(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
                                  const at::Tensor& flat, const std::string& op) {
  ZC_CHECK_VALUE(tensors.size() == offsets.size(), op, ": got ", tensors.size(), " tensors but ",
                    offsets.size(), " offsets");
  check_cpu_contiguous(flat, op, "flat");
  const int64_t esize = flat.element_size();
  std::vector<zc::Segment> segs;
  segs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string arg = "tensors[" + std::to_string(i) + "]";
    check_cpu_contiguous(tensors[i], op, arg);
    ZC_CHECK_TYPE(tensors[i].scalar_type() == flat.scalar_type(), op, ": '", arg, "' has dtype ",
                     tensors[i].scalar_type(), " but 'flat' has ", flat.scalar_type());
    ZC_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + tensors[i].numel() <= flat.numel(), op, ": '", arg,
                      "' with ", tensors[i].numel(), " elements at offset ", offsets[i],
                      " does not fit in 'flat' of ", flat.numel(), " elements");
    segs.push_back({tensors[i].data_ptr(), offsets[i] * esize, tensors[i].numel() * esize});
  }
  return segs;
}

void pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, at::Tensor& flat) {
  const auto segs = segments(tensors, offsets, flat, "pack");
  zc::pack(segs.data(), static_cast<int64_t>(segs.size()), flat.data_ptr(), flat.numel() * flat.element_size(),
           at::get_num_threads());
}

void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets) {
  const auto segs = segments(tensors, offsets, flat, "unpack");
  zc::unpack(flat.data_ptr(), flat.numel() * flat.element_size(), segs.data(), static_cast<int64_t>(segs.size()),
             at::get_num_threads());
}

void cast(const at::Tensor& src, at::Tensor& dst) {
  check_cpu_contiguous(src, "cast", "src");
  check_cpu_contiguous(dst, "cast", "dst");
  const zc::DType s = to_zc(src, "cast", "src"), d = to_zc(dst, "cast", "dst");
  ZC_CHECK_VALUE(src.numel() == dst.numel(), "cast: 'dst' has ", dst.numel(), " elements but 'src' has ",
                    src.numel());
  zc::cast(src.data_ptr(), s, dst.data_ptr(), d, src.numel(), at::get_num_threads());
}

std::tuple<double, bool> sum_squares(const at::Tensor& t) {
  check_cpu_contiguous(t, "sum_squares", "tensor");
  const zc::SumSquares r = zc::sum_squares(t.data_ptr(), to_zc(t, "sum_squares", "tensor"), t.numel(),
                                           at::get_num_threads());
  return {r.sum_sq, r.nonfinite};
}

// The global gradient norm's pass over many tensors in one call: every tensor checked first,
// then each summed exactly as sum_squares does, the sums added in list order (the same
// double additions as a Python loop over sum_squares, so the result is bit-identical).
std::tuple<double, bool> sum_squares_multi(const std::vector<at::Tensor>& tensors) {
  const char* op = "sum_squares_multi";
  std::vector<zc::DType> dts;
  dts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::optional<zc::DType> d = zc_bind::kernel_dtype(t);
    if (!(d && t.device().is_cpu() && t.is_contiguous() && zc_bind::holds_memory(t))) {
      const std::string arg = "tensors[" + std::to_string(i) + "]";
      check_cpu_contiguous(t, op, arg);
      to_zc(t, op, arg);
    }
    dts.push_back(*d);
  }
  double total = 0.0;
  bool nonfinite = false;
  const int threads = at::get_num_threads();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const zc::SumSquares r = zc::sum_squares(tensors[i].data_ptr(), dts[i], tensors[i].numel(), threads);
    total += r.sum_sq;
    nonfinite = nonfinite || r.nonfinite;
  }
  return {total, nonfinite};
}

void stream_rw4(at::Tensor& a, const at::Tensor& b, at::Tensor& c, at::Tensor& d, double s) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a, &b, &c, &d}) check_f32(*t, a.numel(), "stream_rw4", "array");
  zc::stream_rw4(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), d.data_ptr<float>(),
                 static_cast<float>(s), a.numel(), at::get_num_threads());
}

// CRC32C of a CPU tensor's bytes (any dtype), continuing from `crc`; `hardware=false` forces
// the table-driven version (tests).
int64_t crc32c(const at::Tensor& t, int64_t crc, bool hardware) {
  check_cpu_contiguous(t, "crc32c", "tensor");
  ZC_CHECK_VALUE(crc >= 0 && crc <= 0xFFFFFFFFLL, "crc32c: 'crc' must be a 32-bit unsigned value, got ", crc);
  const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
  const uint32_t c = static_cast<uint32_t>(crc);
  return hardware ? zc::crc32c(t.data_ptr(), n, c) : zc::crc32c_scalar(t.data_ptr(), n, c);
}

// Copies src's bytes into dst (same byte count, not overlapping) and returns their CRC32C
// continued from `crc`, in one pass (checkpoint I/O buffers).
int64_t copy_crc32c(const at::Tensor& src, at::Tensor& dst, int64_t crc) {
  check_cpu_contiguous(src, "copy_crc32c", "src");
  check_cpu_contiguous(dst, "copy_crc32c", "dst");
  const int64_t n = src.numel() * static_cast<int64_t>(src.element_size());
  ZC_CHECK_VALUE(dst.numel() * static_cast<int64_t>(dst.element_size()) == n, "copy_crc32c: 'dst' has ",
                 dst.numel() * dst.element_size(), " bytes, 'src' ", n);
  ZC_CHECK_VALUE(crc >= 0 && crc <= 0xFFFFFFFFLL, "copy_crc32c: 'crc' must be a 32-bit unsigned value, got ", crc);
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  ZC_CHECK_VALUE(n == 0 || s + n <= d || d + n <= s, "copy_crc32c: 'src' and 'dst' overlap");
  py::gil_scoped_release nogil;
  return zc::copy_crc32c(s, d, n, static_cast<uint32_t>(crc));
}

std::string active_isa() { return zc::active_kernels().isa; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zerocore native kernels (CPU)";
  // Without the GIL: the offload worker thread steps the host shard while Python trains on.
  m.def("adam_step", &adam_step, "Adam/AdamW step on one flat fp32 shard", py::call_guard<py::gil_scoped_release>());
  m.def("adam_step_multi", &adam_step_multi, "Adam/AdamW step on many tensors in one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("adam_step_multi_from", &adam_step_multi_from,
        "adam_step_multi out of place: reads master, m, v from sources (3 per tensor), writes the others",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack", &pack, "pack tensors into a flat buffer (gaps zeroed)");
  m.def("unpack", &unpack, "unpack a flat buffer into tensors");
  m.def("cast", &cast, "dtype conversion, round-to-nearest-even");
  m.def("sum_squares", &sum_squares, "sum of squares (double) and any-Inf/NaN flag",
        py::call_guard<py::gil_scoped_release>());
  m.def("sum_squares_multi", &sum_squares_multi, "sum of squares (double) and any-Inf/NaN flag over many tensors",
        py::call_guard<py::gil_scoped_release>());
  m.def("stream_rw4", &stream_rw4, "memory roofline probe: read 4 arrays, write 3");
  m.def("crc32c", &crc32c, "CRC32C of a tensor's bytes", py::call_guard<py::gil_scoped_release>());
  m.def("copy_crc32c", &copy_crc32c, "copy a tensor's bytes and return their CRC32C in one pass");
  m.def("crc32c_hardware", &zc::crc32c_hardware, "whether crc32c uses the SSE4.2 instruction here");
  m.def("supported_isas", &zc::supported_isas);
  m.def("set_isa", &zc::set_isa);
  m.def("active_isa", &active_isa);
  m.def("compiler_info", &zc::compiler_info, "compiler and C++ library this extension was built with");
  zc_params::register_params(m);
#ifdef ZEROCORE_WITH_AIO
  register_aio(m);
  m.attr("WITH_AIO") = true;
#else
  m.attr("WITH_AIO") = false;
#endif
#ifdef ZEROCORE_WITH_CUDA
  register_cuda(m);
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
