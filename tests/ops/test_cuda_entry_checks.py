"""No CUDA entry point of zerocore.ops reaches a kernel with input that would crash the process:
the rules test_kernel_args.py holds for every op, for the kinds of bad input added since, plus the
CUDA-only ones, without a GPU (tests/fake_cuda.py: tensors that say cuda:0, a recorder for the
kernel calls).

- memory: a tensor whose storage was freed or shrunk under it (``untyped_storage().resize_``, as
  stage 3 frees a partitioned parameter) would be written through a null or dangling pointer, a
  segfault on the CPU (it was, before these checks) and an illegal address ending the CUDA context
  on a GPU: refused with the same ValueError on both paths, no kernel call;
- sum_squares_multi's CUDA path checks a list in Python when it is not the usual plain CUDA list;
- element alignment (CUDA only: x86 loads any address, a GPU's element loads fault): refused
  for Adam, casts and sums of squares, accepted by pack/unpack (byte copies);
- a CPU tensor given to zerocore.ops.cuda directly, the pinned pool's and async copies' arguments.
On a GPU the same cases run against the real kernels at the end (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from zerocore import ops
from zerocore.ops import cuda as zcuda
from zerocore.ops.cuda import memory

from fake_cuda import FakeCuda, fake, install_recorder, pinned
from test_cuda import DEV, _why_skip
from test_kernel_args import _make, assert_same_refusal

B16 = torch.bfloat16
FREED = "its memory was freed or shrunk"


def _freed(t, *shape, dtype=torch.float32, keep: int = 0):
    """A tensor of ``t``'s kind whose storage now holds ``keep`` bytes (0: freed)."""
    x = t(*shape, dtype=dtype)
    x.untyped_storage().resize_(keep)
    return x


def _adam(t, **wrong):
    """adam_step on four tensors of 10 elements, one of them (or param_out) as ``wrong`` says."""
    a = {"param": t(10), "grad": t(10), "exp_avg": t(10), "exp_avg_sq": t(10), **wrong}
    return ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], lr=1e-3, step=1,
                         param_out=a.get("param_out"))


def _multi(t, at: str, bad):
    lists = {k: [t(3), t(3)] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs")}
    lists[at][1] = bad
    return ops.adam_step_multi(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                               steps=[1, 1], lr=1e-3)


# (name, call(t) with t the tensor factory of the device, exception, message regex)
CASES = [
    ("pack freed tensor", lambda t: ops.pack([_freed(t, 4)], [0], t(8)), ValueError,
     rf"pack: 'tensors\[0\]' has 4 elements but its storage holds 0 of the 16 bytes they need: {FREED}"),
    ("pack shrunk tensor", lambda t: ops.pack([t(2), _freed(t, 4, keep=12)], [0, 4], t(8)), ValueError,
     r"'tensors\[1\]' has 4 elements but its storage holds 12 of the 16 bytes"),
    ("pack freed flat", lambda t: ops.pack([t(4)], [0], _freed(t, 8)), ValueError,
     "pack: 'flat' has 8 elements but its storage holds 0 of the 32 bytes"),
    ("unpack freed destination", lambda t: ops.unpack(t(8), [t(2), _freed(t, 2)], [0, 4]), ValueError,
     r"unpack: 'tensors\[1\]' has 2 elements but its storage holds 0"),
    ("unpack freed flat", lambda t: ops.unpack(_freed(t, 8), [t(2)], [0]), ValueError, "unpack: 'flat' has 8 elements"),
    ("cast freed src", lambda t: ops.cast(_freed(t, 5), dtype=B16), ValueError, f"cast: 'src' has 5 elements.*{FREED}"),
    ("cast freed dst", lambda t: ops.cast(t(5), _freed(t, 5, dtype=B16)), ValueError,
     "cast: 'dst' has 5 elements but its storage holds 0 of the 10 bytes"),
    ("sum_squares freed", lambda t: ops.sum_squares(_freed(t, 7, dtype=B16)), ValueError,
     f"sum_squares: 'tensor' has 7 elements but its storage holds 0 of the 14 bytes they need: {FREED}"),
    ("sum_squares_multi freed", lambda t: ops.sum_squares_multi([t(3), _freed(t, 4)]), ValueError,
     r"sum_squares_multi: 'tensors\[1\]' has 4 elements but its storage holds 0"),
    ("sum_squares_multi not a tensor", lambda t: ops.sum_squares_multi([t(3), "x"]), TypeError,
     r"'tensors\[1\]' must be a torch.Tensor, got str"),
    ("sum_squares_multi dtype", lambda t: ops.sum_squares_multi([t(3), t(3, dtype=torch.int64)]), TypeError,
     r"'tensors\[1\]' has dtype int64"),
    ("sum_squares_multi strided", lambda t: ops.sum_squares_multi([t(3), t(4, 2)[:, 0]]), ValueError,
     r"'tensors\[1\]' must be contiguous"),
    ("sum_squares_multi meta", lambda t: ops.sum_squares_multi([t(3), torch.zeros(3, device="meta")]), ValueError,
     r"'tensors\[1\]' is on meta"),
    ("adam freed param", lambda t: _adam(t, param=_freed(t, 10)), ValueError,
     f"adam_step: 'param' has 10 elements but its storage holds 0 of the 40 bytes they need: {FREED}"),
    ("adam freed grad", lambda t: _adam(t, grad=_freed(t, 10, dtype=B16)), ValueError,
     "adam_step: 'grad' has 10 elements but its storage holds 0 of the 20 bytes"),
    ("adam shrunk exp_avg_sq", lambda t: _adam(t, exp_avg_sq=_freed(t, 10, keep=36)), ValueError,
     "'exp_avg_sq' has 10 elements but its storage holds 36 of the 40 bytes"),
    ("adam freed param_out", lambda t: _adam(t, param_out=_freed(t, 10, dtype=B16)), ValueError,
     "'param_out' has 10 elements but its storage holds 0"),
    ("multi freed grad", lambda t: _multi(t, "grads", _freed(t, 3)), ValueError,
     r"adam_step_multi: 'grads\[1\]' has 3 elements but its storage holds 0 of the 12 bytes"),
    ("multi shrunk exp_avg", lambda t: _multi(t, "exp_avgs", _freed(t, 3, keep=8)), ValueError,
     r"adam_step_multi: 'exp_avgs\[1\]' has 3 elements but its storage holds 8 of the 12 bytes"),
    ("multi freed param", lambda t: _multi(t, "params", _freed(t, 3)), ValueError,
     r"'params\[1\]' has 3 elements but its storage holds 0"),
]


@pytest.mark.parametrize("name, call, exc, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_same_error_on_cpu_and_cuda_paths(name, call, exc, words, monkeypatch):
    assert_same_refusal(name, call, exc, words, monkeypatch)


def test_sparse_tensors_are_named_not_called_contiguous():
    s = torch.zeros(6).to_sparse()
    sparse = "is a sparse_coo tensor; zerocore's kernels take dense tensors"
    for call, name in ((lambda: ops.sum_squares(s), "sum_squares: 'tensor'"),
                       (lambda: ops.sum_squares_multi([torch.ones(2), s]), r"sum_squares_multi: 'tensors\[1\]'"),
                       (lambda: ops.pack([s], [0], torch.zeros(8)), r"pack: 'tensors\[0\]'"),
                       (lambda: ops.cast(s, dtype=B16), "cast: 'src'"),
                       (lambda: ops.adam_step(torch.zeros(6), s, torch.zeros(6), torch.zeros(6), lr=0.1, step=1),
                        "adam_step: 'grad'"),
                       (lambda: ops.adam_step_multi([torch.zeros(6)], [s], [torch.zeros(6)], [torch.zeros(6)],
                                                    steps=[1], lr=0.1), r"adam_step_multi: 'grads\[0\]'")):
        with pytest.raises(ValueError, match=f"{name} {sparse}"):
            call()


def test_the_native_cpu_bindings_refuse_freed_tensors_themselves():
    """A direct call (no Python checks) gets the ValueError too, instead of a segfault."""
    from zerocore.ops import _loader

    mod, t = _loader.load("norm"), _make("cpu")
    with pytest.raises(ValueError, match=r"'tensors\[0\]' has 4 elements but its storage holds 0"):
        mod.sum_squares_multi([_freed(t, 4)])
    with pytest.raises(ValueError, match="storage holds 0"):
        mod.adam_step_multi([t(4)], [_freed(t, 4)], [t(4)], [t(4)], None, [1], 1e-3, 0.9, 0.99, 1e-8, 0.0, True, 1.0)
    with pytest.raises(ValueError, match="'flat' has 8 elements but its storage holds 0"):
        mod.pack([t(4)], [0], _freed(t, 8))
    with pytest.raises(ValueError, match="storage holds 4 of the 16 bytes"):
        mod.crc32c(_freed(t, 4, keep=4), 0, True)


def test_a_refusal_the_fast_checks_missed_is_named_by_the_full_checks(monkeypatch):
    """The fast paths test only for a null pointer (a shrunk storage costs a storage lookup per
    tensor to see): when the native call then refuses, the full checks run and name the tensor,
    on either path (the GPU cases below hold it on a GPU); input they
    find nothing wrong with gets the native error itself."""
    from zerocore.ops import _loader

    class Refuses:
        def __getattr__(self, name):
            def refuse(*args):
                raise ValueError("the native side refuses")
            return refuse

    monkeypatch.setattr(_loader, "_module", Refuses())
    t = _make("cpu")
    shrunk = _freed(t, 4, keep=12)
    for call, words in ((lambda: ops.pack([t(2), shrunk], [0, 4], t(8)), r"pack: 'tensors\[1\]' has 4"),
                        (lambda: ops.adam_step(t(4), t(4), shrunk, t(4), lr=0.1, step=1), "adam_step: 'exp_avg' has 4"),
                        (lambda: ops.adam_step_multi([t(4)], [shrunk], [t(4)], [t(4)], steps=[1], lr=0.1),
                         r"adam_step_multi: 'grads\[0\]' has 4")):
        with pytest.raises(ValueError, match=f"{words} elements but its storage holds 12 of the 16 bytes") as err:
            call()
        assert err.value.__context__ is None  # not chained to the native refusal
    for call in (lambda: ops.pack([t(2)], [0], t(8)), lambda: ops.adam_step(t(4), t(4), t(4), t(4), lr=0.1, step=1),
                 lambda: ops.adam_step_multi([t(4)], [t(4)], [t(4)], [t(4)], steps=[1], lr=0.1)):
        with pytest.raises(ValueError, match="the native side refuses"):
            call()


# ---- CUDA only ------------------------------------------------------------------------------
def _misaligned(n, dtype=torch.float32, *, cuda=True):
    """n elements starting 2 bytes into a buffer: not aligned to a 4-byte element."""
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.frombuffer(bytearray(size * (n + 1)), dtype=dtype, offset=2, count=n)
    assert t.data_ptr() % 4 == 2
    return t.as_subclass(FakeCuda) if cuda else t


@pytest.fixture
def recorder(monkeypatch):
    return install_recorder(monkeypatch)


MISALIGNED = "starts at an address that is not a multiple of its element size"
PAGEABLE = r"is pageable CPU memory; the GPU reads and writes host memory only when it is pinned \(tensor.pin_memory\(\)"


def test_misaligned_tensors_never_reach_the_cuda_kernels_that_load_elements(recorder):
    bad = _misaligned(10)
    for call, name in ((lambda: ops.adam_step(bad, fake(10), fake(10), fake(10), lr=0.1, step=1), "'param'"),
                       (lambda: ops.adam_step(fake(10), fake(10), fake(10), bad, lr=0.1, step=1), "'exp_avg_sq'"),
                       (lambda: ops.adam_step_multi([fake(10), fake(10)], [fake(10), bad], [fake(10), fake(10)],
                                                    [fake(10), fake(10)], steps=[1, 1], lr=0.1), r"'grads\[1\]'"),
                       (lambda: ops.cast(bad, dtype=B16), "'src'"),
                       (lambda: ops.cast(fake(10, dtype=B16), bad), "'dst'"),
                       (lambda: ops.cast(fake(10), _misaligned(10, cuda=False)), "'dst'"),  # host side of a copy
                       (lambda: ops.sum_squares(bad), "'tensor'"),
                       (lambda: ops.sum_squares_multi([fake(3), bad]), r"'tensors\[1\]'")):
        with pytest.raises(ValueError, match=f"{name} {MISALIGNED} \\(4 bytes\\); the CUDA kernels need"):
            call()
    assert recorder.calls == []
    ops.pack([bad], [3], fake(16))  # pack and unpack copy bytes: any address works
    ops.unpack(fake(16), [bad], [3])
    assert [c[0] for c in recorder.calls] == ["cuda_pack", "cuda_unpack"]


def test_the_cpu_kernels_take_misaligned_tensors():
    x = _misaligned(9, cuda=False)
    x.copy_(torch.arange(9.0))
    assert ops.sum_squares(x) == (sum(i * i for i in range(9)), False)
    assert torch.equal(ops.cast(x, dtype=B16), torch.arange(9.0).to(B16))


def test_cpu_tensors_given_to_the_cuda_module_are_refused(recorder):
    cpu = torch.zeros(4)
    cuda_only = "the CUDA kernels take CUDA tensors"
    for call, words in ((lambda: zcuda.pack([cpu], [0], torch.zeros(8)), f"pack: 'flat' is on cpu; {cuda_only}"),
                        (lambda: zcuda.unpack(torch.zeros(8), [cpu], [0]), f"unpack: 'flat' is on cpu; {cuda_only}"),
                        (lambda: zcuda.sum_squares(cpu), f"sum_squares: 'tensor' is on cpu; {cuda_only}"),
                        (lambda: zcuda.cast(cpu, torch.zeros(4, dtype=B16)), "neither 'src' nor 'dst' is a CUDA"),
                        (lambda: zcuda.adam_step(cpu, cpu.clone(), cpu.clone(), cpu.clone(), lr=0.1, step=1),
                         f"adam_step: 'param' is on cpu; {cuda_only}"),
                        (lambda: zcuda.adam_step_multi([cpu], [cpu.clone()], [cpu.clone()], [cpu.clone()], steps=[1],
                                                       lr=0.1),
                         rf"adam_step_multi: 'params\[0\]' is on cpu; {cuda_only}"),
                        (lambda: zcuda.kernels.sum_squares_multi([cpu]),
                         rf"sum_squares_multi: 'tensors\[0\]' is on cpu; {cuda_only}"),
                        (lambda: zcuda.kernels.sum_squares_multi([]), "'tensors' is empty")):
        with pytest.raises(ValueError, match=words):
            call()
    assert recorder.calls == []


class _Stream:
    """What copy_async reads of a torch.cuda.Stream before any CUDA call."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda_stream = 99


def _copier(device="cuda:0"):
    c = memory.AsyncCopier.__new__(memory.AsyncCopier)  # torch.cuda.Stream needs a GPU; the checks come first
    c.device, c.stream, c.pool = torch.device(device), _Stream(device), None
    return c


def test_async_copy_arguments_are_checked_before_the_copy(recorder):
    host, dev = torch.zeros(8), fake(8)
    cases = [
        (lambda: zcuda.copy_async(dev, [0.0] * 8), TypeError, "copy_async: 'src' must be a torch.Tensor, got list"),
        (lambda: zcuda.copy_async(torch.zeros(8), host), ValueError, "neither 'dst' nor 'src' is a CUDA tensor"),
        (lambda: zcuda.copy_async(dev, torch.zeros(7)), ValueError, "'dst' has 32 bytes but 'src' has 28"),
        (lambda: zcuda.copy_async(dev, torch.zeros(8, 2)[:, 0]), ValueError, "'src' must be contiguous"),
        (lambda: zcuda.copy_async(dev, dev), ValueError, "'dst' and 'src' share memory"),
        (lambda: zcuda.copy_async(dev, _freed(lambda *s, dtype: torch.zeros(*s, dtype=dtype), 8)), ValueError,
         f"'src' has 8 elements but its storage holds 0.*{FREED}"),
        (lambda: zcuda.copy_async(dev, host, stream=_Stream("cuda:1")), ValueError,
         "'dst' is on cuda:0 but the copy's stream is on cuda:1"),
        (lambda: _copier().copy(dev, torch.zeros(8, dtype=torch.float64)), TypeError, "dtypes differ"),
        (lambda: _copier("cuda:1").copy(dev, host), ValueError,
         "'dst' is on cuda:0 but the copy's stream is on cuda:1"),
        (lambda: _copier().copy(dev[:4], dev[2:6]), ValueError, "'dst' and 'src' share memory"),
        (lambda: _copier().cast(torch.zeros(8, dtype=B16), dev[:7]), ValueError,
         "'dst' has 8 elements but 'src' has 7"),
        (lambda: _copier().cast(dev.view(B16)[:8], dev), ValueError, "'src' and 'dst' share memory"),
        (lambda: _copier().cast(torch.zeros(8, dtype=torch.float64), dev), TypeError, "'dst' has dtype float64"),
        (lambda: _copier("cuda:1").cast(pinned(8, dtype=B16), dev), ValueError,
         "AsyncCopier.cast: 'src' is on cuda:0 but the copy's stream is on cuda:1"),
        (lambda: zcuda.copy_async(dev, host), ValueError, f"copy_async: 'src' {PAGEABLE}"),
        (lambda: _copier().copy(host, dev), ValueError, f"AsyncCopier.copy: 'dst' {PAGEABLE}"),
        (lambda: _copier().cast(torch.zeros(8, dtype=B16), dev), ValueError, f"AsyncCopier.cast: 'dst' {PAGEABLE}"),
        (lambda: ops.cast(host, fake(8, dtype=B16)), ValueError, f"cast: 'src' {PAGEABLE}"),
        (lambda: ops.cast(dev, torch.zeros(8, dtype=B16)), ValueError, f"cast: 'dst' {PAGEABLE}"),  # as test_cuda
    ]
    for call, exc, words in cases:
        with pytest.raises(exc, match=words):
            call()
    assert recorder.calls == []


def test_pinned_pool_sizes_are_checked_before_allocating():
    pool = memory.PinnedBufferPool.__new__(memory.PinnedBufferPool)  # its block allocator needs a GPU
    asked = []
    pool._pool = type("Blocks", (), {"tensor": lambda self, n: asked.append(n) or torch.zeros(n, dtype=torch.uint8)})()
    for shape, dtype, exc, words in (((3, -2), torch.float32, ValueError, r"'shape\[1\]' must be >= 0, got -2"),
                                     ((2.5,), torch.float32, TypeError, r"'shape\[0\]' must be an integer"),
                                     ((4,), "float32", TypeError, "'dtype' must be a torch.dtype")):
        with pytest.raises(exc, match=words):
            pool.empty(shape, dtype)
    assert asked == []
    assert pool.empty((2, 3), B16).shape == (2, 3) and asked == [12]


# ---- the same on a GPU ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, call, exc, words", CASES, ids=[c[0] for c in CASES])
@pytest.mark.gpu
@pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))
def test_bad_input_same_error_on_a_real_gpu(name, call, exc, words):
    with pytest.raises(exc, match=words) as on_cpu:
        call(_make("cpu"))
    with pytest.raises(exc, match=words) as on_gpu:
        call(lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=DEV))
    assert str(on_gpu.value) == str(on_cpu.value)
    torch.cuda.synchronize()  # nothing was launched that could fault later


class _Foreign:
    """CUDA memory at an address torch would never give a float tensor (2 bytes into a block)."""

    def __init__(self, base: torch.Tensor, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (base.data_ptr() + 2, False),
                                         "strides": None, "version": 2}


@pytest.mark.gpu
@pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))
def test_the_cuda_binding_refuses_by_itself_before_launching():
    """Straight into the binding (no Python checks): ValueError/TypeError, nothing launched, and the
    device still works afterwards (a fault would have ended the CUDA context)."""
    mod, stream = zcuda.kernels.lib(), torch.cuda.current_stream(DEV).cuda_stream
    base = torch.zeros(1000, dtype=torch.float16, device=DEV)
    flat = torch.zeros(1000, dtype=torch.float16, device=DEV)
    views = [base[1:8], base[3:700], base[701:702]]
    with pytest.raises(ValueError, match="does not fit"):
        mod.cuda_pack(views, [5, 13, 1000], flat, stream)  # the H100 crash of 2026-11-22
    with pytest.raises(ValueError, match="share memory"):
        mod.cuda_pack([flat[:4]], [10], flat, stream)
    with pytest.raises(ValueError, match="share memory"):
        mod.cuda_unpack(flat, [base[:4], base[2:6]], [0, 10], stream)
    freed = torch.zeros(64, device=DEV)
    freed.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="storage holds 0"):
        mod.cuda_sum_squares(freed, stream)
    with pytest.raises(ValueError, match="storage holds 0"):
        mod.cuda_adam_step_multi([torch.zeros(64, device=DEV)], [freed], [torch.zeros(64, device=DEV)],
                                 [torch.zeros(64, device=DEV)], [], [1], 1e-3, 0.9, 0.99, 1e-8, 0.0, True, 1.0, None,
                                 stream)
    backing = torch.zeros(64, device=DEV)  # outlives the foreign view of it
    odd = torch.as_tensor(_Foreign(backing, 16), device=DEV)
    assert odd.data_ptr() == backing.data_ptr() + 2
    with pytest.raises(ValueError, match=MISALIGNED):
        mod.cuda_sum_squares(odd, stream)
    with pytest.raises(ValueError, match=MISALIGNED):
        mod.cuda_cast(odd, torch.empty(16, dtype=B16, device=DEV), stream)
    x = torch.zeros(16, device=DEV)
    with pytest.raises(ValueError, match="'src' and 'dst' share memory"):
        mod.cuda_cast(x, x.view(B16)[:16], stream)
    with pytest.raises(ValueError, match=MISALIGNED):  # and through zerocore.ops, named in Python
        ops.sum_squares(odd)
    torch.cuda.synchronize()
    assert ops.sum_squares(torch.ones(5, device=DEV)) == (5.0, False)
