"""zerocore.debug.host_waits itself: what it counts, where it says the wait is, raising, cost when off.

"The device" on this CPU machine: ``fake_cuda.FakeCuda`` tensors (CPU memory that says cuda:0), or CPU
tensors with ``device="cpu"``; CUDA synchronisation is monkeypatched stand-ins (a CPU build has none).
The engine under the mode: ``test_host_waits_engine.py``.
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import zerocore
from fake_cuda import fake, install_recorder
from zerocore.debug import HostWaitError, device_read, host_waits, mark_host

HERE = __file__


def _line_of(fn_text: str) -> int:
    with open(HERE) as f:
        for i, line in enumerate(f, 1):
            if fn_text in line:
                return i
    raise AssertionError(fn_text)


def test_item_float_int_bool_tolist_of_a_device_tensor():
    t = fake(4)
    with host_waits() as log:
        t[0].item()
        float(t[1])
        int(t[2])
        bool(t[3])
        if t[0]:
            pass
        t.tolist()
    assert log.count == 6 and [w.kind for w in log.waits] == ["item"] * 6
    assert all(w.site.startswith(HERE + ":") for w in log.waits)
    assert "Tensor.tolist" in log.waits[-1].what


def test_host_tensors_do_not_count_unless_the_cpu_is_the_device():
    t = torch.ones(3)
    with host_waits() as log:
        t[0].item(), t.tolist()
    assert log.count == 0
    with host_waits(device="cpu") as log:
        t[0].item(), t.tolist()
        h = mark_host(torch.ones(3))  # offload's host buffers: host memory even then
        h[0].item(), h[1:].tolist()
    assert log.count == 2


def test_a_blocking_copy_to_host_memory_counts_a_non_blocking_one_does_not():
    src = fake(5)
    dst = torch.empty(5)
    with host_waits() as log:
        dst.copy_(src)
        dst.copy_(src, non_blocking=True)
        fake(5).copy_(src)  # device to device
        dst.copy_(torch.ones(5))  # host to host
    assert [(w.kind, w.what) for w in log.waits] == [("copy", "aten.copy_ into host memory")]
    with host_waits(device="cpu") as log:
        h = mark_host(torch.empty(5))
        h.copy_(torch.ones(5))  # the CPU device's memory into a host buffer: a device-to-host copy
        h.copy_(torch.ones(5), non_blocking=True)
        torch.empty(5).copy_(h)  # host to device
    assert log.count == 1


def test_synchronisations_and_events(monkeypatch):
    # stand-ins for what a CPU build cannot run; the mode wraps whatever is there
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: None)
    for name in ("synchronize", "query", "elapsed_time"):
        monkeypatch.setattr(torch.cuda.Event, name, lambda self, *a: True)
    # the methods are called through their classes with a stand-in ``self``: an Event or Stream cannot be made
    # here (torch's CUDA build refuses ``object.__new__`` of its C types, and making one would need a GPU)
    ev, stream = object(), object()
    with host_waits() as log:
        torch.cuda.synchronize()
        torch.cuda.Stream.synchronize(stream)
        torch.cuda.Event.synchronize(ev)
        torch.cuda.Event.query(ev)
        torch.cuda.Event.elapsed_time(ev, ev)
    assert [w.kind for w in log.waits] == ["sync", "sync", "event", "event", "event"]
    assert log.count == 2 and len(log.events) == 3  # an event wait is not a wait for the device
    with pytest.raises(HostWaitError, match="torch.cuda.Event.synchronize"):
        with host_waits(raise_on_events=True):
            torch.cuda.Event.synchronize(ev)


def test_native_calls_returning_host_values_from_device_data(monkeypatch):
    install_recorder(monkeypatch)  # zerocore.ops' CUDA paths record, and return CPU stand-in results
    with host_waits() as log:
        zerocore.ops.sum_squares(fake(4))  # (float, bool): waits
        zerocore.ops.sum_squares(fake(4), sync=False)  # device tensors: no wait
        zerocore.ops.sum_squares_multi([fake(4), fake(2)])
        zerocore.ops.sum_squares_multi([fake(4)], sync=False)
        zerocore.ops.sum_squares(torch.ones(3))  # host data
    assert [(w.kind, w.what) for w in log.waits] == [("native", "zerocore.ops.sum_squares"),
                                                    ("native", "zerocore.ops.sum_squares_multi")]
    assert log.waits[0].site == f"{HERE}:{_line_of('zerocore.ops.sum_squares(fake(4))  #')} in " \
                                "test_native_calls_returning_host_values_from_device_data"
    with host_waits(device="cpu") as log:
        zerocore.ops.sum_squares(torch.ones(3))
        zerocore.ops.sum_squares(mark_host(torch.ones(3)))
    assert log.count == 1


def test_raise_names_the_call_site():
    t = fake(2)
    with pytest.raises(HostWaitError) as info:
        with host_waits(raise_on_wait=True):
            t.sum().item()  # the wait
    line = _line_of("t.sum().item()  # the wait")
    assert f"{HERE}:{line} in test_raise_names_the_call_site" in str(info.value)


def test_a_kernel_reading_its_own_scalar_and_other_threads_are_not_counted():
    t = fake(2)
    with host_waits(device="cpu") as log:
        assert device_read(torch.tensor([2.0])) == 2.0  # a CPU kernel's argument: a CUDA kernel reads it itself
        worker = threading.Thread(target=lambda: (t[0].item(), t.tolist()))
        worker.start()
        worker.join()
    assert log.count == 0


def test_nested_contexts_each_count():
    t = fake(2)
    with host_waits() as outer:
        t[0].item()
        with host_waits() as inner:
            t.tolist()
    assert (outer.count, inner.count) == (2, 1)


def test_off_it_leaves_nothing_installed():
    originals = (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize,
                 zerocore.ops.sum_squares, zerocore.ops.norm.sum_squares_multi)
    with host_waits():
        assert _get_current_dispatch_mode() is not None
        assert torch.Tensor.tolist is not torch._C.TensorBase.tolist
    assert _get_current_dispatch_mode() is None
    assert "tolist" not in torch.Tensor.__dict__
    assert (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize,
            zerocore.ops.sum_squares, zerocore.ops.norm.sum_squares_multi) == originals
    with pytest.raises(HostWaitError):  # and after an exception too
        with host_waits(raise_on_wait=True):
            fake(1).item()
    assert _get_current_dispatch_mode() is None and "tolist" not in torch.Tensor.__dict__
