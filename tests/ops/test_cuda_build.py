"""The CUDA part without a GPU: build configuration, the Python dispatch, and (slow) the whole
extension with its CUDA part built and loaded against the CPU torch.

Compiling every .cu for sm_80/sm_90 is CI's CMake build (csrc/cuda/cuda.cmake: a compile error
fails `cmake --build`), whose ctest also runs csrc/cuda/test_cuda_host.cpp (the device math and
launch planning against the CPU kernels) and checks that the binding links against the kernels.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import torch

import zerocore
from zerocore import ops
from zerocore.ops import _loader, build_spec
from zerocore.ops import cuda as zcuda
from zerocore.ops.cuda import _lib

from fake_cuda import fake, install_recorder, pinned

ROOT = build_spec.repo_root()
NVCC = next((p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                         shutil.which("nvcc")) if p and os.path.exists(p)), None)


# ---- build configuration --------------------------------------------------------------------
def test_cuda_config_without_cuda_torch_says_why():
    cfg = build_spec.cuda_config(ROOT, torch_has_cuda=False)
    assert cfg["sources"] == [] and "CPU-only build" in cfg["unavailable"]
    assert "cuda" in build_spec.extension_config(ROOT, torch_has_cuda=False)["unavailable"]


def test_cuda_config_with_cuda_torch(monkeypatch):
    if NVCC is None:
        pytest.skip("no nvcc here")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    cfg = build_spec.cuda_config(ROOT, torch_has_cuda=True)
    assert cfg["unavailable"] is None
    every_cu = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    assert cfg["sources"] == every_cu + ["csrc/bindings_cuda.cpp"]
    assert ("ZEROCORE_WITH_CUDA", None) in cfg["define_macros"]
    assert "-O3" in cfg["extra_cuda_args"] and "--use_fast_math" not in cfg["extra_cuda_args"]
    assert [a for a in cfg["extra_cuda_args"] if a.startswith("-gencode")] == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 8.6+PTX;9.0a")
    assert [a for a in build_spec.cuda_config(ROOT, True)["extra_cuda_args"] if a.startswith("-gencode")] == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_86,code=compute_86", "-gencode=arch=compute_90a,code=sm_90a"]
    full = build_spec.extension_config(ROOT, torch_has_cuda=True)
    assert full["with_cuda"] and "cuda" not in full["unavailable"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        build_spec.cuda_config(ROOT, True)
    monkeypatch.setenv("ZEROCORE_CUDA", "0")
    assert "ZEROCORE_CUDA=0" in build_spec.cuda_config(ROOT, True)["unavailable"]


def test_cuda_config_without_nvcc(monkeypatch):
    monkeypatch.setattr(os.path, "exists", lambda p: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "nvcc was not found" in build_spec.cuda_config(ROOT, True)["unavailable"]


@pytest.mark.skipif(NVCC is None, reason="no nvcc here")
def test_nvcc_accepts_the_build_flags(tmp_path):
    """The flags setup.py / the JIT build hand nvcc compile a kernel file, and the object says
    which architectures it was built for."""
    cfg = build_spec.cuda_config(ROOT, True)
    out = tmp_path / "info.o"
    r = subprocess.run([NVCC, *cfg["extra_cuda_args"], "-Xcompiler", "-fPIC", "-I", os.path.join(ROOT, "csrc"),
                        "-c", os.path.join(ROOT, "csrc", "cuda", "info.cu"), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 0


# ---- Python dispatch --------------------------------------------------------------------------
@pytest.fixture
def no_cuda_build(monkeypatch):
    monkeypatch.setattr(_lib, "_module", lambda: None)
    monkeypatch.setattr(_lib, "unavailable_reason", lambda: "test: built against a CPU-only torch")


def test_without_cuda_kernels_cuda_tensors_get_the_clear_error(no_cuda_build):
    p, g, m, v = fake(4), fake(4), fake(4), fake(4)
    with pytest.raises(ValueError, match="not built into this installation"):
        ops.adam_step(p, g, m, v, lr=1e-3, step=1)
    w = torch.nn.Parameter(fake(3))
    w.grad = fake(3)
    with pytest.raises(ValueError, match="CUDA multi-tensor Adam is not built"):
        zerocore.FusedAdam([w]).step()
    for call in (lambda: zcuda.adam_step_multi([p], [g], [m], [v], steps=[1], lr=1e-3),
                 lambda: zcuda.pack([p], [0], fake(8)), lambda: zcuda.PinnedBufferPool()):
        with pytest.raises(zcuda.CudaUnavailableError, match="CPU-only torch.*pip install --no-build-isolation"):
            call()
    assert not zcuda.available() and not zcuda.build_info()["built"]


@pytest.fixture
def recorder(monkeypatch):
    return install_recorder(monkeypatch)


def test_ops_route_cuda_tensors_to_the_cuda_kernels(recorder):
    p, g, m, v, o = fake(5), fake(5, dtype=torch.bfloat16), fake(5), fake(5), fake(5, dtype=torch.float16)
    ops.adam_step(p, g, m, v, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, step=7, adamw_mode=False,
                  grad_scale=0.5, param_out=o)
    name, args = recorder.calls[-1]
    assert name == "cuda_adam_step_multi"
    assert [a[0] is t for a, t in zip(args[:5], (p, g, m, v, o))] == [True] * 5
    assert args[5:] == ([7], 0.1, 0.8, 0.9, 1e-6, 0.2, False, 0.5, None, 1234)
    scale = fake(1)
    p2, g2, m2, v2 = fake(5), fake(5, dtype=torch.bfloat16), fake(5), fake(5)
    ops.adam_step_multi([p, p2], [g, g2], [m, m2], [v, v2], steps=[1, 2], lr=0.1, grad_scale=scale)
    name, args = recorder.calls[-1]
    assert args[4] == [] and args[5] == [1, 2] and args[12] == 1.0 and args[13] is scale
    flat = fake(16)
    ops.pack([p, m], [0, 8], flat)
    ops.unpack(flat, [p], [3])
    assert [c[0] for c in recorder.calls[-2:]] == ["cuda_pack", "cuda_unpack"]
    assert recorder.calls[-2][1][1:] == ([0, 8], flat, 1234) and recorder.calls[-1][1][2:] == ([3], 1234)
    pinned_like = pinned(5)
    ops.cast(p, pinned_like)  # device -> host: still the CUDA path (the kernel writes host memory)
    assert recorder.calls[-1][0] == "cuda_cast" and recorder.calls[-1][1][1] is pinned_like
    assert ops.sum_squares(p) == (4.0, False)
    total, flag = ops.sum_squares(p, sync=False)
    assert isinstance(total, torch.Tensor) and isinstance(flag, torch.Tensor)
    n = len(recorder.calls)
    ops.sum_squares(torch.ones(3))  # CPU tensors never reach the CUDA path
    ops.adam_step(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3), lr=0.1, step=1)
    assert len(recorder.calls) == n


def test_fused_adam_routes_cuda_params_and_keeps_cpu_ones(recorder):
    gpu = torch.nn.Parameter(fake(4))
    gpu.grad = fake(4)
    cpu = torch.nn.Parameter(torch.ones(3))
    cpu.grad = torch.ones(3)
    opt = zerocore.FusedAdam([gpu, cpu], lr=0.01)
    opt.step()
    opt.step()
    calls = [c for c in recorder.calls if c[0] == "cuda_adam_step_multi"]
    assert len(calls) == 2 and calls[1][1][0][0] is gpu and len(calls[1][1][0]) == 1
    assert calls[0][1][5] == [1] and calls[1][1][5] == [2]  # per-parameter step counts
    assert not torch.equal(cpu.detach(), torch.ones(3))  # the CPU parameter was stepped on the CPU


# ---- the whole extension with its CUDA part, built against this (CPU) torch -----------------------
@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="no nvcc here")
def test_extension_with_cuda_part_builds_loads_and_fails_cleanly_without_a_device(tmp_path, monkeypatch):
    """Builds zerocore._C as setup.py would with a CUDA torch (same sources and nvcc flags), but
    against the CPU torch: the CUDA runtime is linked statically instead of through torch. ~2 min."""
    from torch.utils import cpp_extension

    cfg = build_spec.cuda_config(ROOT, True)
    objs = []
    for src in cfg["sources"]:
        if src.endswith(".cu"):
            obj = str(tmp_path / (os.path.basename(src) + ".o"))
            subprocess.run([NVCC, *cfg["extra_cuda_args"], "-Xcompiler", "-fPIC", "-I", os.path.join(ROOT, "csrc"),
                            "-c", os.path.join(ROOT, src), "-o", obj], check=True)
            objs.append(obj)
    cuda_lib = os.path.join(os.path.dirname(os.path.dirname(NVCC)), "lib64")
    mod = cpp_extension.load(
        name="zc_cuda_probe", build_directory=str(tmp_path),
        sources=[os.path.join(ROOT, p) for p in build_spec.KERNEL_SOURCES + [build_spec.BINDING_SOURCE,
                                                                              "csrc/bindings_cuda.cpp"]],
        extra_include_paths=build_spec.include_dirs(ROOT),
        extra_cflags=build_spec.CXX_FLAGS + ["-DZEROCORE_WITH_CUDA"],
        extra_ldflags=objs + [f"-L{cuda_lib}", "-lcudart_static", "-lrt", "-ldl", "-lpthread"] + build_spec.LINK_FLAGS)
    assert mod.WITH_CUDA is True
    assert mod.cuda_device_count() == 0 and "cuda" in mod.cuda_device_error().lower()
    assert sorted(mod.cuda_compiled_archs()) == [800, 900] and mod.cuda_runtime_version() >= 13000
    with pytest.raises(RuntimeError, match="zerocore CUDA"):
        mod.cuda_kernel_versions(0)
    with pytest.raises(RuntimeError, match="cudaHostAlloc"):
        mod.CudaPinnedPool(0).tensor(100)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        mod.cuda_adam_step_multi([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [], [1],
                                 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, None, 0)
    with pytest.raises(ValueError, match="neither"):
        mod.cuda_memcpy_async(torch.zeros(2), torch.zeros(2), 0)
    assert mod.cuda_pinned_block_bytes(5000) == 8192
    # The Python side sees it as a CUDA-capable build.
    monkeypatch.setattr(_loader, "_module", mod)
    assert zcuda.available()
    info = zcuda.build_info()
    assert info["built"] and info["archs"] == ["sm_80", "sm_90"] and info["devices"] == 0 and info["device_error"]


def test_cuda_buckets_pack_their_gradients_through_one_binding_call(recorder, monkeypatch):
    """The reducer's packer for a CUDA device is the CUDA binding's pack_grads (one launch per group, on the
    device's current stream); a CPU device keeps the CPU one."""
    from zerocore.ops import params
    from zerocore.ops.cuda import _lib

    monkeypatch.setattr(_lib, "stream_handle", lambda device: 1234)
    pack_grads = params.pack_grads_on(torch.device("cuda", 0))
    ps, flat = [fake(3)], fake(8)
    pack_grads(ps, [0], flat)
    name, args = recorder.calls[-1]
    assert name == "cuda_pack_grads" and args[0] is ps and args[1] == [0] and args[2] is flat and args[3] == 1234
    assert params.pack_grads_on(torch.device("cpu")) is params.param_ops().pack_grads


@pytest.mark.slow
def test_cuda_variants_benchmark_builds(tmp_path):
    """benchmarks/cuda_variants.py's binary (csrc/bench/cuda_variants.cu, run only on a lent GPU) compiles
    and links here: a compile error found on the GPU machine costs minutes of its 15."""
    if NVCC is None:
        pytest.skip("no nvcc here")
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import cuda_variants
    finally:
        sys.path.pop(0)
    exe = cuda_variants.build(str(tmp_path))
    assert os.path.isfile(exe) and os.access(exe, os.X_OK)
