"""The one argument-checking layer of zerocore.ops: every op checks its arguments here, on the
CPU and on CUDA alike, before anything reaches native code, so bad input gets the same
TypeError/ValueError naming the op and the argument on every device (never a pybind
"incompatible function arguments", a wrapped-around offset or a crash in a kernel launch).

Rules shared by every op:
- tensors are torch.Tensors on the op's device (the CPU, or one CUDA device; ``cast`` may read
  or write host memory from a CUDA kernel), dense and contiguous, of a dtype the kernel takes,
  with the memory their elements need (not a freed or shrunk storage: a kernel would write
  through a null or dangling pointer); on CUDA, element-aligned where a kernel loads elements;
- integers (offsets, step counts) are ints or integer-like (``operator.index``), never floats
  or bools, and in range for the kernels' int64;
- what an op writes shares no memory with anything else it reads or writes.
The native bindings check again (a direct call cannot crash); this layer is what users meet.
"""
from __future__ import annotations

import math
import operator

import torch

FLOAT16S = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32,) + FLOAT16S
KERNEL_DTYPES = GRAD_DTYPES
F32 = (torch.float32,)
INT64_MAX = 2**63 - 1


def dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def _dtypes_text(dtypes) -> str:
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# ---- numbers ------------------------------------------------------------------------------
def check_number(name: str, value, *, low: float = 0.0, high: float | None = None, high_open=True) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name} must be a number, got a tensor of {value.numel()} elements")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    if high is not None and (v >= high if high_open else v > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {v}")
    return v


def check_int(name: str, value, *, low: int | None = None, high: int | None = INT64_MAX) -> int:
    """An integer argument: an int or integer-like (numpy ints, integer 0-d tensors), never a
    float (1.5 is not silently 1, and 1.0 is refused as everywhere else) nor a bool."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high} (int64), got {v}")
    return v


def check_step(name: str, value) -> int:
    """A step count including this update: an integer >= 1."""
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int >= 1 (the count including this update), got {value!r}")
    return check_int(name, value, low=1)


def check_betas(betas) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return (check_number("betas[0]", betas[0], high=1.0), check_number("betas[1]", betas[1], high=1.0))


def check_adam_hyper(lr, betas, eps, weight_decay) -> tuple[float, float, float, float, float]:
    """Adam's shared hyper-parameters as floats (lr, beta1, beta2, eps, weight_decay), checked
    in that order; ValueError/TypeError naming a bad one."""
    if type(betas) in (tuple, list) and len(betas) == 2:  # the usual valid floats: inline, no calls
        b1, b2 = betas
        if (type(lr) is float and type(b1) is float and type(b2) is float and type(eps) is float
                and type(weight_decay) is float and 0.0 <= lr < math.inf and 0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0
                and 0.0 <= eps < math.inf and 0.0 <= weight_decay < math.inf):
            return lr, b1, b2, eps, weight_decay
    lr = check_number("lr", lr)
    beta1, beta2 = check_betas(betas)
    return lr, beta1, beta2, check_number("eps", eps), check_number("weight_decay", weight_decay)


def check_dtype_arg(op: str, dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: 'dtype' must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: 'dtype' is {dtype_name(dtype)}; expected {_dtypes_text(KERNEL_DTYPES)}")
    return dtype


# ---- tensors ------------------------------------------------------------------------------
def check_home(op: str, name: str, t, *, cuda: bool) -> torch.device:
    """The tensor that decides where an op runs: a tensor on the CPU (``cuda=False``) or on a
    CUDA device (``cuda=True``). Returns its device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: '{name}' must be a torch.Tensor, got {type(t).__name__}")
    dev = t.device
    if cuda and dev.type != "cuda":
        raise ValueError(f"{op}: '{name}' is on {dev}; the CUDA kernels take CUDA tensors")
    if not cuda and dev.type != "cpu":
        if dev.type == "cuda":
            raise ValueError(
                f"{op}: '{name}' is on {dev}; zerocore's native kernels for cuda tensors are not built into this "
                "installation (CPU kernels only)")
        raise ValueError(f"{op}: '{name}' is on {dev}; zerocore's kernels take CPU or CUDA tensors")
    return dev


def check_tensor(op: str, name: str, t, dtypes, *, device: torch.device, home: str, numel: int | None = None,
                 ref: str | None = None, host_ok: bool = False, aligned: bool = False) -> None:
    """``t`` is a contiguous tensor of one of ``dtypes`` on ``device`` (the device of the op's
    ``home`` argument; with ``host_ok`` also CPU memory) with ``numel`` elements (those of ``ref``),
    and memory behind them (:func:`check_memory`; ``aligned``: element-aligned too)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: '{name}' must be a torch.Tensor, got {type(t).__name__}")
    dev = t.device
    if dev != device and not (host_ok and dev.type == "cpu"):
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"{op}: '{name}' is on {dev}; zerocore's kernels take CPU or CUDA tensors")
        raise ValueError(f"{op}: '{name}' is on {dev} but '{home}' is on {device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: '{name}' has dtype {dtype_name(t.dtype)}; expected {_dtypes_text(dtypes)}")
    check_dense(op, name, t)
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{op}: '{name}' has {t.numel()} elements but '{ref}' has {numel}")
    check_memory(op, name, t, aligned=aligned)


def check_dense(op: str, name: str, t: torch.Tensor) -> None:
    """A strided (not sparse) contiguous tensor: the kernels walk its elements as one array."""
    if t.layout != torch.strided:
        raise ValueError(f"{op}: '{name}' is a {str(t.layout).replace('torch.', '')} tensor; zerocore's kernels "
                         "take dense tensors (call .to_dense())")
    if not t.is_contiguous():
        raise ValueError(f"{op}: '{name}' must be contiguous (call .contiguous())")


def check_memory(op: str, name: str, t: torch.Tensor, *, aligned: bool = False) -> None:
    """The (contiguous) tensor's storage holds the bytes its elements need. A storage freed or
    shrunk under the tensor (``untyped_storage().resize_(0)``, as stage 3 frees a partitioned
    parameter outside ``zerocore.gathered()``) leaves a null or dangling data pointer that a
    kernel would write through: a segfault on the CPU, an illegal address that ends the process's
    CUDA context on a GPU. ``aligned``: the address is a multiple of the element size, as the
    CUDA kernels' element loads need (torch's own tensors always are; memory from elsewhere, e.g.
    ``torch.frombuffer(..., offset=1)`` or a foreign ``__cuda_array_interface__``, may not be)."""
    n = t.numel()
    if n == 0:
        return
    esize = t.element_size()
    try:
        have = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass with no storage of its own
        raise TypeError(f"{op}: '{name}' ({type(t).__name__}) has no storage of its own; zerocore's kernels take "
                        "tensors backed by memory") from None
    need = (t.storage_offset() + n) * esize
    if have < need:
        raise ValueError(f"{op}: '{name}' has {n} elements but its storage holds {have} of the {need} bytes they "
                         "need: its memory was freed or shrunk (e.g. a stage-3 parameter outside zerocore.gathered())")
    if aligned and t.data_ptr() % esize:
        raise ValueError(f"{op}: '{name}' starts at an address that is not a multiple of its element size "
                         f"({esize} bytes); the CUDA kernels need element-aligned tensors (call .clone())")


def check_pinned(op: str, name: str, t: torch.Tensor) -> None:
    """Host memory that a CUDA kernel or an async copy reads or writes directly is page-locked:
    the GPU cannot address pageable memory (a cast kernel would fault; an async copy would
    silently become a synchronous staged one). Only the CUDA runtime can tell (``is_pinned``)."""
    if t.device.type == "cpu" and t.numel() and not t.is_pinned():
        raise ValueError(f"{op}: '{name}' is pageable CPU memory; the GPU reads and writes host memory only when it "
                         "is pinned (tensor.pin_memory() or a PinnedBufferPool buffer)")


def check_disjoint(op: str, named) -> None:
    """No two of the (name, tensor) pairs share a byte of memory: an op that writes one of
    them while reading or writing another would give results that depend on thread timing."""
    names = [name for name, _ in named]
    pair = _overlapping_pair(t for _, t in named)
    if pair is not None:
        a, b = names[min(pair)], names[max(pair)]  # in argument order, whatever the addresses
        raise ValueError(f"{op}: '{a}' and '{b}' share memory; the op needs separate tensors")


def _overlapping_pair(tensors) -> tuple[int, int] | None:
    """The indices of two tensors sharing a byte of memory (neighbours in address order), or None."""
    spans = []
    for k, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if n:
            p = t.data_ptr()
            spans.append((p, p + n, k))
    spans.sort()
    for (_, end, k1), (start, _, k2) in zip(spans, spans[1:]):
        if start < end:
            return k1, k2
    return None


def check_list(op: str, name: str, value) -> list:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: '{name}' must be a sequence of tensors, got a tensor")
    if not hasattr(value, "__iter__"):
        raise TypeError(f"{op}: '{name}' must be a sequence, got {type(value).__name__}")
    return list(value)


# ---- per-op argument sets -----------------------------------------------------------------
def _home_index(t, cuda: bool) -> int | None:
    """The fast paths' device of the home tensor: a CUDA index, -1 for the CPU, None: use the full checks."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        return None
    if cuda:
        index = t.get_device() if t.is_cuda else -1
        return index if index >= 0 else None
    return -1 if t.is_cpu else None


def _pack_fast(tensors, offsets, flat, cuda: bool):
    """pack's usual case (tensors in ascending offsets, every check passing) in a few attribute
    reads per tensor; None when anything is unusual (the full checks then decide)."""
    if type(tensors) not in (list, tuple) or type(offsets) not in (list, tuple) or len(tensors) != len(offsets):
        return None
    if not isinstance(flat, torch.Tensor) or not flat.is_contiguous():  # _home_index inline: a call less
        return None
    if cuda:
        index = flat.get_device() if flat.is_cuda else -1
        if index < 0:
            return None
    elif not flat.is_cpu:
        return None
    else:
        index = -1
    dtype, total, esize = flat.dtype, flat.numel(), flat.element_size()
    lo = flat.data_ptr()
    if not lo and total:  # a freed bucket: the full checks name it
        return None
    hi = lo + total * esize
    end = 0
    for t, o in zip(tensors, offsets):  # inline tests only: the engine packs a whole group per call
        if type(o) is not int or o < end or not isinstance(t, torch.Tensor):
            return None
        n = t.numel()
        if o + n > total or t.dtype != dtype or not t.is_contiguous():
            return None
        if (not t.is_cuda or t.get_device() != index) if cuda else not t.is_cpu:
            return None
        if n:
            p = t.data_ptr()
            if not p or (p < hi and lo < p + n * esize):  # freed, or inside flat: the full checks name it
                return None
        end = o + n
    return list(tensors), list(offsets)


def pack_args(op: str, tensors, offsets, flat, *, cuda: bool, fast: bool = True) -> tuple[list, list[int]]:
    """pack/unpack: ``tensors[i]`` at element ``offsets[i]`` of ``flat``, same dtype, inside it,
    not overlapping each other in ``flat``, sharing no memory with ``flat``; unpack's
    destinations share none with each other either (pack may read one tensor twice).
    ``fast=False``: no fast path (after the binding refused what the fast path let through, e.g. a
    shrunk storage, which only the full checks measure)."""
    if fast:
        checked = _pack_fast(tensors, offsets, flat, cuda)
        # unpack writes every tensor: they may not share memory with each other either (pack may
        # read one twice). Without this fast path unpack's full checks cost ~2.4 us a tensor: for a
        # 200-tensor bucket longer than the GPU's copy (0.42x torch._foreach_copy_ on an H200).
        if checked is not None and (op == "pack" or _overlapping_pair(checked[0]) is None):
            return checked
    device = check_home(op, "flat", flat, cuda=cuda)
    check_dense(op, "flat", flat)
    check_memory(op, "flat", flat)  # pack and unpack are byte copies: any alignment works
    tensors = check_list(op, "tensors", tensors)
    offsets = check_list(op, "offsets", offsets)
    if len(offsets) != len(tensors):
        raise ValueError(f"{op}: got {len(tensors)} tensors but {len(offsets)} offsets")
    total, dtype = flat.numel(), (flat.dtype,)
    offs, spans = [], []
    for i, (t, o) in enumerate(zip(tensors, offsets)):
        name = f"tensors[{i}]"
        check_tensor(op, name, t, dtype, device=device, home="flat")
        o = check_int(f"{op}: 'offsets[{i}]'", o, high=None)
        n = t.numel()
        if o < 0 or o + n > total:
            raise ValueError(f"{op}: '{name}' with {n} elements at offset {o} does not fit in 'flat' of {total} "
                             "elements")
        offs.append(o)
        spans.append((o, n, i))
    spans.sort(key=lambda s: s[0])  # stable: the native kernels' neighbour rule, exactly
    for (o1, n1, i1), (o2, _, i2) in zip(spans, spans[1:]):
        if o1 + n1 > o2:
            raise ValueError(f"{op}: 'tensors[{i1}]' and 'tensors[{i2}]' overlap in the flat buffer")
    if op == "pack":
        for i, t in enumerate(tensors):
            check_disjoint(op, [("flat", flat), (f"tensors[{i}]", t)])
    else:
        check_disjoint(op, [("flat", flat)] + [(f"tensors[{i}]", t) for i, t in enumerate(tensors)])
    return tensors, offs


def cast_args(op: str, src, dst, dtype, *, cuda: bool):
    """cast: returns (src, dst or None, dtype of the dst to allocate or None). ``dtype`` given
    with ``dst`` must be dst's dtype."""
    if cuda and isinstance(src, torch.Tensor) and not src.is_cuda:
        if not isinstance(dst, torch.Tensor) or not dst.is_cuda:
            raise ValueError(f"{op}: neither 'src' nor 'dst' is a CUDA tensor")
        device = dst.device  # a host -> device cast: the kernel reads pinned host memory
        check_tensor(op, "src", src, KERNEL_DTYPES, device=device, home="dst", host_ok=True, aligned=True)
    else:
        device = check_home(op, "src", src, cuda=cuda)
        check_tensor(op, "src", src, KERNEL_DTYPES, device=device, home="src", aligned=cuda)
    if dtype is not None:
        dtype = check_dtype_arg(op, dtype)
    if dst is None:
        if dtype is None:
            raise ValueError(f"{op}: cast needs 'dst' or 'dtype'")
        return src, None, dtype
    check_tensor(op, "dst", dst, KERNEL_DTYPES, device=device, home="src", numel=src.numel(), ref="src",
                 host_ok=cuda, aligned=cuda)
    if dtype is not None and dst.dtype != dtype:
        raise ValueError(f"{op}: dtype={dtype_name(dtype)} but 'dst' has dtype {dtype_name(dst.dtype)}; give one "
                         "or make them agree")
    check_disjoint(op, [("src", src), ("dst", dst)])
    if cuda:  # one side may be host memory, which the kernel reads or writes itself
        check_pinned(op, "src", src)
        check_pinned(op, "dst", dst)
    return src, dst, None


def copy_args(op: str, dst, src, *, device: torch.device | None = None) -> torch.device:
    """A byte copy (zerocore.ops.cuda.copy_async, AsyncCopier.copy): ``dst`` and ``src`` tensors,
    one on a CUDA device (``device`` if given: the copier's stream's), the other there too or in
    pinned host memory, dense, contiguous, backed, the same number of bytes, sharing none.
    Returns the CUDA side's device."""
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: '{name}' must be a torch.Tensor, got {type(t).__name__}")
    home, side = ("dst", dst) if dst.is_cuda else ("src", src)
    if not side.is_cuda:
        raise ValueError(f"{op}: neither 'dst' nor 'src' is a CUDA tensor")
    if device is not None and side.device != device:
        raise ValueError(f"{op}: '{home}' is on {side.device} but the copy's stream is on {device}")
    device = side.device
    for name, t in (("dst", dst), ("src", src)):
        check_tensor(op, name, t, (t.dtype,), device=device, home=home, host_ok=True)
    nd, ns = dst.numel() * dst.element_size(), src.numel() * src.element_size()
    if nd != ns:
        raise ValueError(f"{op}: 'dst' has {nd} bytes but 'src' has {ns}")
    check_disjoint(op, [("dst", dst), ("src", src)])
    check_pinned(op, "dst", dst)
    check_pinned(op, "src", src)
    return device


def sum_squares_args(op: str, t, *, cuda: bool, name: str = "tensor", device: torch.device | None = None) -> None:
    """One tensor of sum_squares (``name``; with ``device``: it must be there, as the first of a list is)."""
    if device is None:
        device = check_home(op, name, t, cuda=cuda)
        home = name
    else:  # a later tensor of a list: named against the first, on either path
        home = "tensors[0]"
    check_tensor(op, name, t, KERNEL_DTYPES, device=device, home=home, aligned=cuda)


def sum_squares_multi_args(op: str, tensors, *, cuda: bool) -> None:
    """sum_squares_multi's list: every tensor as sum_squares takes it, all on the first one's device."""
    first = None
    for i, t in enumerate(tensors):
        sum_squares_args(op, t, cuda=cuda, name=f"tensors[{i}]", device=first)
        first = first or t.device


# Tensor types whose device the C++ bindings see as Python does: the multi-tensor ops let the
# bindings check these (a subclass may report another device or dtype from Python properties,
# so its lists take the Python checks).
PLAIN = (torch.Tensor, torch.nn.Parameter)


def steps_plain(steps) -> bool:
    """Every step count a plain int >= 1 (the native bindings then check the rest), in one loop
    without a call per entry: the multi-tensor ops' fast path."""
    for s in steps:
        if type(s) is not int or s < 1 or s > INT64_MAX:
            return False
    return True


def _adam_fast(p, g, m, v, out, cuda: bool, spans: list) -> bool:
    """One Adam tensor set in its usual, valid form (appending its byte spans to ``spans`` for
    the caller's overlap check); False when anything is unusual (the full checks then decide)."""
    index = _home_index(p, cuda)
    if index is None:
        return False
    n = p.numel()
    for t, dtypes in ((p, F32), (g, GRAD_DTYPES), (m, F32), (v, F32), (out, FLOAT16S)):
        if t is None and dtypes is FLOAT16S:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.numel() != n or not t.is_contiguous():
            return False
        if (not t.is_cuda or t.get_device() != index) if cuda else not t.is_cpu:  # inline: per group
            return False
        if n:
            a, size = t.data_ptr(), t.element_size()
            if not a or (cuda and a % size):  # freed or misaligned: the full checks name it
                return False
            spans.append((a, a + n * size))
    return True


def _adam_multi_fast(params, grads, exp_avgs, exp_avg_sqs, outs, cuda: bool) -> bool:
    """adam_step_multi's usual, valid input, in one tight loop (a few attribute reads per
    tensor, no calls per tensor): True when every set is fine, all on params[0]'s device, and
    no two tensors share memory; False sends the caller to the full checks."""
    index = _home_index(params[0], cuda)
    if index is None:
        return False
    f32, grad_dtypes, f16s = torch.float32, GRAD_DTYPES, FLOAT16S
    spans = []
    add = spans.append
    for j, p in enumerate(params):
        g, m, v = grads[j], exp_avgs[j], exp_avg_sqs[j]
        n = p.numel()
        if p.dtype is not f32 or m.dtype is not f32 or v.dtype is not f32 or g.dtype not in grad_dtypes \
                or m.numel() != n or v.numel() != n or g.numel() != n or not p.is_contiguous() \
                or not m.is_contiguous() or not v.is_contiguous() or not g.is_contiguous():
            return False
        if cuda:
            if p.get_device() != index or m.get_device() != index or v.get_device() != index \
                    or g.get_device() != index or not p.is_cuda:
                return False
        elif not (p.is_cpu and m.is_cpu and v.is_cpu and g.is_cpu):
            return False
        if n:
            a, b, c, d = p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr()
            gsize = g.element_size()
            if not (a and b and c and d) or (cuda and ((a | b | c) & 3 or d % gsize)):  # freed or misaligned
                return False
            add((a, a + 4 * n))
            add((b, b + 4 * n))
            add((c, c + 4 * n))
            add((d, d + n * gsize))
        if outs is not None:
            o = outs[j]
            if o.dtype not in f16s or o.numel() != n or not o.is_contiguous() \
                    or not ((o.is_cuda and o.get_device() == index) if cuda else o.is_cpu):
                return False
            if n:
                e = o.data_ptr()
                if not e or (cuda and e & 1):
                    return False
                add((e, e + 2 * n))
    return _spans_disjoint(spans)


def _spans_disjoint(spans: list) -> bool:
    spans.sort()
    return all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))


def adam_tensor_args(op: str, p, g, m, v, out, *, cuda: bool, index: int | None = None,
                     device: torch.device | None = None, fast: bool = True) -> torch.device:
    """One Adam tensor set: fp32 param / exp_avg / exp_avg_sq, fp32/bf16/fp16 grad, optional
    bf16/fp16 param_out, all of param's size, on param's device, sharing no memory. ``index``:
    the position in adam_step_multi's lists (names become 'params[i]', ...)."""
    def nm(single, multi):
        return single if index is None else f"{multi}[{index}]"

    if index is None and fast:
        spans = []
        if _adam_fast(p, g, m, v, out, cuda, spans) and _spans_disjoint(spans):
            return p.device
    pn = nm("param", "params")
    dev = check_home(op, pn, p, cuda=cuda)
    if device is not None and dev != device and not cuda:
        raise ValueError(f"{op}: '{pn}' is on {dev} but 'params[0]' is on {device}")
    check_tensor(op, pn, p, F32, device=dev, home=pn, aligned=cuda)
    n = p.numel()
    check_tensor(op, nm("grad", "grads"), g, GRAD_DTYPES, device=dev, home=pn, numel=n, ref=pn, aligned=cuda)
    check_tensor(op, nm("exp_avg", "exp_avgs"), m, F32, device=dev, home=pn, numel=n, ref=pn, aligned=cuda)
    check_tensor(op, nm("exp_avg_sq", "exp_avg_sqs"), v, F32, device=dev, home=pn, numel=n, ref=pn, aligned=cuda)
    if out is not None:
        check_tensor(op, nm("param_out", "param_outs"), out, FLOAT16S, device=dev, home=pn, numel=n, ref=pn,
                     aligned=cuda)
    if index is None:  # adam_step_multi checks all its tensors together
        check_disjoint(op, [("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)] +
                       ([("param_out", out)] if out is not None else []))
    return dev


def adam_multi_args(op: str, params, grads, exp_avgs, exp_avg_sqs, param_outs, steps, *, cuda: bool,
                    fast: bool = True):
    """adam_step_multi's lists, checked tensor by tensor (naming the index) and as a whole
    (equal lengths, integer steps, no memory shared between tensors). Returns them as lists
    (param_outs: None or a list) and the steps as ints. ``fast=False``: as pack_args."""
    params, grads = check_list(op, "params", params), check_list(op, "grads", grads)
    exp_avgs, exp_avg_sqs = check_list(op, "exp_avgs", exp_avgs), check_list(op, "exp_avg_sqs", exp_avg_sqs)
    steps = check_list(op, "steps", steps)
    outs = None if param_outs is None else check_list(op, "param_outs", param_outs)
    n = len(params)
    lengths = {"grads": len(grads), "exp_avgs": len(exp_avgs), "exp_avg_sqs": len(exp_avg_sqs), "steps": len(steps)}
    if outs is not None:
        lengths["param_outs"] = len(outs)
    for key, length in lengths.items():
        if length != n:
            raise ValueError(f"{op}: 'params' has {n} entries but '{key}' has {length}; they must have the same "
                             "length")
    for i, o in enumerate(outs or ()):  # all or nothing: a None is not "no output for this one"
        if o is None:
            raise TypeError(f"{op}: 'param_outs[{i}]' must be a torch.Tensor, got NoneType")
    if n and fast and steps_plain(steps):
        try:
            usual = _adam_multi_fast(params, grads, exp_avgs, exp_avg_sqs, outs, cuda)
        except (AttributeError, TypeError):  # not tensors: the full checks name it
            usual = False
        if usual:
            return params, grads, exp_avgs, exp_avg_sqs, outs, steps
    first = None
    for i in range(n):
        dev = adam_tensor_args(op, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                               None if outs is None else outs[i], cuda=cuda, index=i, device=first)
        first = first or dev
    int_steps = [check_step(f"{op}: 'steps[{i}]'", s) for i, s in enumerate(steps)]
    named = []
    for key, ts in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                    ("param_outs", outs or ())):
        named.extend((f"{key}[{i}]", t) for i, t in enumerate(ts))
    check_disjoint(op, named)
    return params, grads, exp_avgs, exp_avg_sqs, outs, int_steps
