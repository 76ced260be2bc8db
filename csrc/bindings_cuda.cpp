// Python binding of the CUDA kernels (csrc/cuda/api.h), registered into zerocore._C by
// csrc/bindings.cpp when ZEROCORE_WITH_CUDA is defined.
//
// Why this file includes no ATen CUDA header (ATen/cuda/*, c10/cuda/*): streams come from
// Python as integers (torch.cuda.current_stream(device).cuda_stream) and the device is made
// current inside the kernels' own C++ layer, so only torch's CPU headers are needed. That
// keeps the binding compiling against every torch, the CPU build included: CI compiles it
// on every run (csrc/cuda/cuda.cmake), although the extension with CUDA is built only
// against a CUDA torch; and it compiles in seconds instead of minutes.
//
// Every function takes the stream to run on; it must be the current stream of the tensors'
// device (the Python side passes exactly that), because the few torch operations used here
// (allocating a workspace, staging a table to the device) run on torch's current stream.
#include <torch/extension.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "adam/adam.h"
#include "binding_dtype.h"
#include "binding_grads.h"
#include "binding_memory.h"
#include "binding_spans.h"
#include "cuda/api.h"

namespace {

namespace zcc = zc::cuda;

cudaStream_t as_stream(uint64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }

using zc_bind::to_zc;

// A contiguous CUDA tensor on `device` (-1: any CUDA device) with memory behind its elements
// (`aligned`: at an address the kernels' element loads take). Returns its device index.
int check_cuda(const at::Tensor& t, const std::string& op, const std::string& arg, int device = -1,
               bool aligned = false) {
  ZC_CHECK_VALUE(t.defined(), op, ": '", arg, "' is undefined");
  ZC_CHECK_VALUE(t.is_cuda(), op, ": '", arg, "' is on ", t.device(), "; expected a CUDA tensor");
  ZC_CHECK_VALUE(device < 0 || t.get_device() == device, op, ": '", arg, "' is on ", t.device(),
                    " but the first tensor is on cuda:", device);
  ZC_CHECK_VALUE(t.is_contiguous(), op, ": '", arg, "' must be contiguous (call .contiguous())");
  zc_bind::check_memory(t, op, arg, aligned);
  return t.get_device();
}

// Everything check_cuda checks, as one expression for the per-tensor fast paths (no strings).
bool fine_cuda(const at::Tensor& t, int device, bool aligned) {
  return t.defined() && t.is_cuda() && t.get_device() == device && t.layout() == at::kStrided && t.is_contiguous() &&
         zc_bind::holds_memory(t) && (!aligned || zc_bind::element_aligned(t));
}

// Whether the byte ranges of a and b are disjoint (a kernel may write one while reading the other).
bool apart(const at::Tensor& a, const at::Tensor& b) {
  const int64_t na = a.numel() * static_cast<int64_t>(a.element_size());
  const int64_t nb = b.numel() * static_cast<int64_t>(b.element_size());
  if (na == 0 || nb == 0) return true;
  const auto pa = reinterpret_cast<uintptr_t>(a.data_ptr()), pb = reinterpret_cast<uintptr_t>(b.data_ptr());
  return pa + static_cast<uintptr_t>(na) <= pb || pb + static_cast<uintptr_t>(nb) <= pa;
}

void check_apart(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn, const std::string& op) {
  ZC_CHECK_VALUE(apart(a, b), op, ": '", an, "' and '", bn, "' share memory; the op needs separate tensors");
}

void check_f32(const at::Tensor& t, int64_t numel, int device, const std::string& op, const std::string& arg) {
  check_cuda(t, op, arg, device, /*aligned=*/true);
  ZC_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": '", arg, "' must be float32, got ", t.scalar_type());
  ZC_CHECK_VALUE(t.numel() == numel, op, ": '", arg, "' has ", t.numel(), " elements but 'param' has ", numel);
}

// ---- Adam ------------------------------------------------------------------------------
void adam_step_multi(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<std::optional<at::Tensor>>& param_outs, const std::vector<int64_t>& steps,
                     double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                     double grad_scale, const std::optional<at::Tensor>& grad_scale_tensor, uint64_t stream) {
  const char* op = "adam_step_multi (CUDA)";
  const size_t n = params.size();
  ZC_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                        (param_outs.empty() || param_outs.size() == n),
                    op, ": params, grads, exp_avgs, exp_avg_sqs, steps (and param_outs if given) must have the "
                    "same length");
  if (n == 0) return;
  const int device = check_cuda(params[0], op, "params[0]");
  const float* dgs = nullptr;
  if (grad_scale_tensor.has_value()) {
    const at::Tensor& s = *grad_scale_tensor;
    check_cuda(s, op, "grad_scale", device, /*aligned=*/true);
    ZC_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": a grad_scale tensor must be float32, got ", s.scalar_type());
    ZC_CHECK_VALUE(s.numel() == 1, op, ": a grad_scale tensor must have one element, got ", s.numel());
    dgs = s.data_ptr<float>();
  }
  std::vector<zc::AdamTensor> ts;
  ts.reserve(n);
  zc_bind::Spans spans(5 * n);
  zc::AdamScalars s{};
  int64_t scalars_step = -1;  // steps are usually all equal: fold the scalars once per value
  const bool with_outs = !param_outs.empty();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& v = exp_avg_sqs[i];
    // param_outs is all or nothing, as on the CPU: a None among tensors is refused, not skipped
    ZC_CHECK_TYPE(!with_outs || param_outs[i].has_value(), op, ": 'param_outs[", i,
                  "]' must be a torch.Tensor, got NoneType");
    const at::Tensor* o = with_outs ? &*param_outs[i] : nullptr;
    // Fast path: every check in one expression, messages built only when one fails.
    const int64_t numel = p.numel();
    auto fine_f32 = [&](const at::Tensor& t) {
      return fine_cuda(t, device, true) && t.scalar_type() == at::kFloat && t.numel() == numel;
    };
    const bool ok = fine_f32(p) && fine_f32(m) && fine_f32(v) && fine_cuda(g, device, true) && g.numel() == numel &&
                    (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16 ||
                     g.scalar_type() == at::kHalf) &&
                    (o == nullptr || (fine_cuda(*o, device, true) && o->numel() == numel &&
                                      (o->scalar_type() == at::kBFloat16 || o->scalar_type() == at::kHalf)));
    if (!ok) {  // the slow path names the argument and what is wrong
      const std::string sfx = "[" + std::to_string(i) + "]";
      check_f32(p, numel, device, op, "params" + sfx);
      check_cuda(g, op, "grads" + sfx, device, /*aligned=*/true);
      to_zc(g, op, "grads" + sfx);
      ZC_CHECK_VALUE(g.numel() == numel, op, ": 'grads", sfx, "' has ", g.numel(), " elements but 'params", sfx,
                        "' has ", numel);
      check_f32(m, numel, device, op, "exp_avgs" + sfx);
      check_f32(v, numel, device, op, "exp_avg_sqs" + sfx);
      if (o != nullptr) {
        check_cuda(*o, op, "param_outs" + sfx, device, /*aligned=*/true);
        const zc::DType odt = to_zc(*o, op, "param_outs" + sfx);
        ZC_CHECK_TYPE(odt != zc::DType::F32, op, ": 'param_outs", sfx, "' must be bfloat16 or float16, got float32");
        ZC_CHECK_VALUE(o->numel() == numel, op, ": 'param_outs", sfx, "' has ", o->numel(),
                          " elements but 'params", sfx, "' has ", numel);
      }
      ZC_CHECK_VALUE(false, op, ": tensor ", i, " failed a check");  // not reached
    }
    if (steps[i] != scalars_step) {
      s = zc::adam_scalars(lr, beta1, beta2, eps, weight_decay, steps[i], adamw, grad_scale);
      scalars_step = steps[i];
    }
    zc::AdamTensor t{p.data_ptr<float>(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), nullptr, numel,
                     g.scalar_type() == at::kFloat ? zc::DType::F32
                                                   : (g.scalar_type() == at::kBFloat16 ? zc::DType::BF16 : zc::DType::F16),
                     zc::DType::F32, s};
    if (o != nullptr) {
      t.param_out = o->data_ptr();
      t.out_dtype = o->scalar_type() == at::kBFloat16 ? zc::DType::BF16 : zc::DType::F16;
    }
    ts.push_back(t);
    const auto k = static_cast<int64_t>(i);
    spans.add(p, "params", 0, k);
    spans.add(g, "grads", 1, k);
    spans.add(m, "exp_avgs", 2, k);
    spans.add(v, "exp_avg_sqs", 3, k);
    if (o != nullptr) spans.add(*o, "param_outs", 4, k);
  }
  spans.check_disjoint(op);  // before anything is launched
  zcc::adam_step_multi(ts.data(), static_cast<int64_t>(n), dgs, device, as_stream(stream));
}

// ---- pack / unpack ---------------------------------------------------------------------
// The segments' pieces (plan_pack: bounds, overlaps) copied in one launch: the table by value
// when it fits the kernel parameters, else staged to device memory.
void launch_pieces(const std::vector<zc::Segment>& segs, const at::Tensor& flat, bool pack, int device,
                   uint64_t stream) {
  const int64_t flat_bytes = flat.numel() * flat.element_size();
  const std::vector<zcc::PackPiece> pieces = zcc::plan_pack(segs.data(), static_cast<int64_t>(segs.size()), flat_bytes, pack);
  if (pieces.empty() || flat_bytes == 0) return;
  if (static_cast<int64_t>(pieces.size()) <= zcc::pack_inline_capacity()) {  // the usual bucket: table by value
    zcc::pack_pieces_inline(pieces.data(), static_cast<int64_t>(pieces.size()), flat.data_ptr(), flat_bytes, pack,
                            device, as_stream(stream));
    return;
  }
  // A larger piece table travels through pinned memory on the current stream; torch's pinned
  // allocator keeps the host block until that copy is done, its caching allocator keeps the
  // device block until the kernel (same stream) is done.
  const int64_t table_bytes = static_cast<int64_t>(pieces.size() * sizeof(zcc::PackPiece));
  at::Tensor host = at::empty({table_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), pieces.data(), static_cast<size_t>(table_bytes));
  at::Tensor table = host.to(flat.device(), /*non_blocking=*/true);
  zcc::pack_pieces(static_cast<const zcc::PackPiece*>(table.data_ptr()), static_cast<int64_t>(pieces.size()),
                   flat.data_ptr(), flat_bytes, pack, device, as_stream(stream));
}

void pack_impl(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, const at::Tensor& flat,
               bool pack, uint64_t stream) {
  const std::string op = pack ? "pack (CUDA)" : "unpack (CUDA)";
  ZC_CHECK_VALUE(tensors.size() == offsets.size(), op, ": got ", tensors.size(), " tensors but ", offsets.size(),
                    " offsets");
  const int device = check_cuda(flat, op, "flat");  // byte copies: any alignment works
  const int64_t esize = flat.element_size();
  std::vector<zc::Segment> segs;
  segs.reserve(tensors.size());
  // What the op writes shares no memory with what it reads (pack may read one tensor twice).
  zc_bind::Spans spans(pack ? 0 : tensors.size() + 1);
  if (!pack) spans.add(flat, "flat", 0, -1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const bool ok = fine_cuda(t, device, false) && t.scalar_type() == flat.scalar_type() && offsets[i] >= 0 &&
                    offsets[i] <= flat.numel() - t.numel();
    if (!ok) {
      const std::string arg = "tensors[" + std::to_string(i) + "]";
      check_cuda(t, op, arg, device);
      ZC_CHECK_TYPE(t.scalar_type() == flat.scalar_type(), op, ": '", arg, "' has dtype ", t.scalar_type(),
                       " but 'flat' has ", flat.scalar_type());
      ZC_CHECK_VALUE(false, op, ": '", arg, "' with ", t.numel(), " elements at offset ", offsets[i],
                        " does not fit in 'flat' of ", flat.numel(), " elements");
    }
    if (pack) {
      ZC_CHECK_VALUE(apart(flat, t), op, ": 'flat' and 'tensors[", i, "]' share memory; the op needs separate tensors");
    } else {
      spans.add(t, "tensors", 1, static_cast<int64_t>(i));
    }
    segs.push_back({t.data_ptr(), offsets[i] * esize, t.numel() * esize});
  }
  if (!pack) spans.check_disjoint(op.c_str());
  launch_pieces(segs, flat, pack, device, stream);
}

// Stages 2/3's hot path: a group's `.grad`s into its reduction bucket in one launch (gaps zeroed),
// then dropped, as zerocore._C's CPU pack_grads with the same rules (binding_grads.h): false,
// touching nothing, where they refuse; the caller then packs through the checked op, which names
// what is wrong. (A copy_ per gradient costs ~15 us of host time each on a GPU: 35 of them in a
// Llama's last group.)
bool pack_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets, at::Tensor& flat,
                uint64_t stream) {
  ZC_CHECK_VALUE(params.size() == offsets.size(), "pack_grads (CUDA): ", params.size(), " parameters but ",
                    offsets.size(), " offsets");
  std::vector<zc_bind::GradPiece> pieces;
  if (!flat.defined() || !flat.is_cuda() || !zc_bind::packable_grads(params, offsets, flat, pieces)) return false;
  const int64_t esize = flat.element_size();
  std::vector<zc::Segment> segs;
  segs.reserve(pieces.size());
  for (const auto& piece : pieces) segs.push_back({piece.data, piece.offset * esize, piece.numel * esize});
  launch_pieces(segs, flat, /*pack=*/true, flat.get_device(), stream);
  zc_bind::drop_grads(params);  // the caching allocator reuses their memory after the launch
  return true;
}

void pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, const at::Tensor& flat,
          uint64_t stream) {
  pack_impl(tensors, offsets, flat, true, stream);
}
void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
            uint64_t stream) {
  pack_impl(tensors, offsets, flat, false, stream);
}

// ---- cast ------------------------------------------------------------------------------
// src and dst: CUDA tensors on one device, or one CUDA tensor and one pinned CPU tensor.
void cast(const at::Tensor& src, const at::Tensor& dst, uint64_t stream) {
  const char* op = "cast (CUDA)";
  ZC_CHECK_VALUE(src.is_cuda() || dst.is_cuda(), op, ": neither 'src' nor 'dst' is a CUDA tensor");
  ZC_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous(), op, ": 'src' and 'dst' must be contiguous");
  const int device = src.is_cuda() ? src.get_device() : dst.get_device();
  for (const at::Tensor* t : {&src, &dst}) {
    const char* arg = t == &src ? "src" : "dst";
    ZC_CHECK_VALUE(t->is_cuda() ? t->get_device() == device : t->device().is_cpu(), op, ": '", arg, "' is on ",
                      t->device(), "; expected cuda:", device, " or pinned CPU memory");
  }
  const zc::DType s = to_zc(src, op, "src"), d = to_zc(dst, op, "dst");
  ZC_CHECK_VALUE(src.numel() == dst.numel(), op, ": 'dst' has ", dst.numel(), " elements but 'src' has ", src.numel());
  zc_bind::check_memory(src, op, "src", /*aligned=*/true);
  zc_bind::check_memory(dst, op, "dst", /*aligned=*/true);
  check_apart(src, "src", dst, "dst", op);
  zcc::cast(src.data_ptr(), s, dst.data_ptr(), d, src.numel(), device, as_stream(stream));
}

// ---- sum of squares ----------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> sum_squares(const at::Tensor& t, uint64_t stream) {
  const char* op = "sum_squares (CUDA)";
  const int device = check_cuda(t, op, "tensor", -1, /*aligned=*/true);
  const zc::DType dt = to_zc(t, op, "tensor");
  const auto opts = at::TensorOptions().device(t.device());
  at::Tensor ws = at::empty({zcc::sum_squares_workspace(t.numel())}, opts.dtype(at::kDouble));
  at::Tensor sum = at::empty({}, opts.dtype(at::kDouble));
  at::Tensor flag = at::empty({}, opts.dtype(at::kBool));
  zcc::sum_squares(t.data_ptr(), dt, t.numel(), ws.data_ptr<double>(), sum.data_ptr<double>(), flag.data_ptr<bool>(),
                   device, as_stream(stream));
  return {sum, flag};
}

// Many tensors on one device: a [n, 2] float64 device tensor of (sum of squares, Inf/NaN as
// 0/1) rows, one launch sequence on one stream and no host sync; every tensor is checked
// before the first launch. The caller sums the rows on the device (as it summed the stacked
// per-tensor results before: the same values, the same reduction).
at::Tensor sum_squares_multi(const std::vector<at::Tensor>& tensors, uint64_t stream) {
  const char* op = "sum_squares_multi (CUDA)";
  const int64_t n = static_cast<int64_t>(tensors.size());
  ZC_CHECK_VALUE(n > 0, op, ": 'tensors' is empty");
  const int device = check_cuda(tensors[0], op, "tensors[0]");
  std::vector<zc::DType> dts;
  dts.reserve(tensors.size());
  int64_t ws_elems = 1;
  for (int64_t i = 0; i < n; ++i) {
    const std::string arg = "tensors[" + std::to_string(i) + "]";
    check_cuda(tensors[i], op, arg, device, /*aligned=*/true);
    dts.push_back(to_zc(tensors[i], op, arg));
    ws_elems = std::max(ws_elems, zcc::sum_squares_workspace(tensors[i].numel()));
  }
  const auto opts = at::TensorOptions().device(tensors[0].device());
  // Launches on one stream run in order: one workspace serves them all.
  at::Tensor ws = at::empty({ws_elems}, opts.dtype(at::kDouble));
  at::Tensor sums = at::empty({n}, opts.dtype(at::kDouble));
  at::Tensor flags = at::empty({n}, opts.dtype(at::kBool));
  for (int64_t i = 0; i < n; ++i) {
    zcc::sum_squares(tensors[i].data_ptr(), dts[i], tensors[i].numel(), ws.data_ptr<double>(),
                     sums.data_ptr<double>() + i, flags.data_ptr<bool>() + i, device, as_stream(stream));
  }
  return at::stack({sums, flags.to(at::kDouble)}, 1);
}

// ---- pinned memory and copies ----------------------------------------------------------
// A CPU uint8 tensor of `nbytes` over a pool block; freeing the tensor returns the block.
at::Tensor pool_tensor(const std::shared_ptr<zcc::PinnedPool>& pool, int64_t nbytes) {
  ZC_CHECK_VALUE(nbytes >= 0, "PinnedPool: nbytes must be >= 0, got ", nbytes);
  void* p = pool->acquire(nbytes);
  std::shared_ptr<zcc::PinnedPool> keep = pool;  // the pool lives as long as its tensors
  return torch::from_blob(
      p, {nbytes},
      [keep](void* ptr) {
        try {
          keep->release(ptr);
        } catch (...) {
        }
      },
      at::TensorOptions().dtype(at::kByte));
}

void memcpy_async(const at::Tensor& dst, const at::Tensor& src, uint64_t stream) {
  const char* op = "copy_async (CUDA)";
  ZC_CHECK_VALUE(dst.is_cuda() || src.is_cuda(), op, ": neither 'dst' nor 'src' is a CUDA tensor");
  ZC_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), op, ": 'dst' and 'src' must be contiguous");
  const int64_t nbytes = src.numel() * src.element_size();
  ZC_CHECK_VALUE(dst.numel() * dst.element_size() == nbytes, op, ": 'dst' has ", dst.numel() * dst.element_size(),
                    " bytes but 'src' has ", nbytes);
  const int device = dst.is_cuda() ? dst.get_device() : src.get_device();
  for (const at::Tensor* t : {&dst, &src}) {
    const char* arg = t == &dst ? "dst" : "src";
    zc_bind::check_memory(*t, op, arg);
    if (t->is_cuda()) {
      ZC_CHECK_VALUE(t->get_device() == device, op, ": 'dst' and 'src' are on different CUDA devices");
    } else {
      ZC_CHECK_VALUE(t->device().is_cpu() && zcc::is_pinned_host(t->data_ptr()), op, ": '", arg, "' is ",
                        t->device().is_cpu() ? "pageable CPU memory" : t->device().str(),
                        "; an async copy needs pinned memory (tensor.pin_memory() or a PinnedBufferPool buffer)");
    }
  }
  check_apart(dst, "dst", src, "src", op);
  zcc::memcpy_async(dst.data_ptr(), src.data_ptr(), nbytes, device, as_stream(stream));
}

}  // namespace

void register_cuda(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("cuda_device_count", &zcc::device_count, "CUDA devices the kernels' runtime sees (0 without a driver)");
  m.def("cuda_device_error", &zcc::device_error, "why cuda_device_count() is 0 ('' if it is not)");
  m.def("cuda_compiled_archs", &zcc::compiled_archs, "virtual architectures the kernels were compiled for");
  m.def("cuda_runtime_version", &zcc::runtime_version_compiled, "CUDA runtime version the kernels were built with");
  m.def("cuda_kernel_versions", &zcc::kernel_versions, py::arg("device"),
        "(binary, PTX) version of the kernel image the device would run");
  m.def("cuda_adam_step_multi", &adam_step_multi, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("param_outs"), py::arg("steps"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("grad_scale"),
        py::arg("grad_scale_tensor"), py::arg("stream"), "multi-tensor Adam/AdamW step on CUDA tensors");
  m.def("cuda_pack", &pack, py::arg("tensors"), py::arg("offsets"), py::arg("flat"), py::arg("stream"),
        "pack CUDA tensors into a flat CUDA buffer in one launch (gaps zeroed)");
  m.def("cuda_pack_grads", &pack_grads, py::arg("params"), py::arg("offsets"), py::arg("flat"), py::arg("stream"),
        "params' .grad into a CUDA bucket at offsets in one launch (gaps zeroed), then dropped; false (nothing "
        "touched) where a gradient does not fit the fast path");
  m.def("cuda_unpack", &unpack, py::arg("flat"), py::arg("tensors"), py::arg("offsets"), py::arg("stream"),
        "unpack a flat CUDA buffer into CUDA tensors in one launch");
  m.def("cuda_cast", &cast, py::arg("src"), py::arg("dst"), py::arg("stream"),
        "dtype conversion on the GPU (one side may be pinned host memory)");
  m.def("cuda_sum_squares", &sum_squares, py::arg("tensor"), py::arg("stream"),
        "(sum of squares as a float64 device scalar, any-Inf/NaN as a bool device scalar)");
  m.def("cuda_sum_squares_multi", &sum_squares_multi, py::arg("tensors"), py::arg("stream"),
        "[n, 2] float64 device tensor of (sum of squares, any-Inf/NaN) per tensor, no host sync");
  m.def("cuda_memcpy_async", &memcpy_async, py::arg("dst"), py::arg("src"), py::arg("stream"),
        "cudaMemcpyAsync between a CUDA tensor and a pinned CPU tensor (or two CUDA tensors)");
  m.def("cuda_is_pinned", [](const at::Tensor& t) { return t.device().is_cpu() && zcc::is_pinned_host(t.data_ptr()); },
        "whether a CPU tensor's memory is page-locked");
  m.def("cuda_pinned_block_bytes", &zcc::pinned_block_bytes, "bytes the pinned pool reserves for a request");

  py::class_<zcc::PinnedPool, std::shared_ptr<zcc::PinnedPool>>(m, "CudaPinnedPool")
      .def(py::init<int64_t, bool>(), py::arg("limit_bytes") = 0, py::arg("cache") = true)
      .def("tensor", &pool_tensor, py::arg("nbytes"), "a uint8 CPU tensor over a pinned block of the pool")
      .def(
          "record_use",
          [](zcc::PinnedPool& pool, const at::Tensor& t, int device, uint64_t stream) {
            return pool.record_use(t.data_ptr(), device, as_stream(stream));
          },
          py::arg("tensor"), py::arg("device"), py::arg("stream"),
          "work queued on stream uses this buffer: do not hand it out again before it is done")
      .def("capacity", [](zcc::PinnedPool& pool, const at::Tensor& t) { return pool.capacity(t.data_ptr()); })
      .def("trim", &zcc::PinnedPool::trim, "free idle blocks whose copies are done; returns bytes freed")
      .def("stats", [](zcc::PinnedPool& pool) {
        const zcc::PinnedPool::Stats s = pool.stats();
        py::dict d;
        d["reserved_bytes"] = s.reserved_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["peak_reserved_bytes"] = s.peak_reserved_bytes;
        d["limit_bytes"] = s.limit_bytes;
        d["blocks"] = s.blocks;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        return d;
      });
}
