"""pack/unpack against the plain-torch reference: odd sizes, gaps (zeroed), every dtype,
large buckets (multithreaded path), and errors that name the tensor."""
import pytest
import torch

from zerocore import ops
from zerocore.ops.reference import pack_reference

from conftest import SIZES


def _layout(sizes, gen, gap_max=5):
    offsets, cursor = [], 0
    for n in sizes:
        cursor += int(torch.randint(0, gap_max + 1, (1,), generator=gen))
        offsets.append(cursor)
        cursor += n
    return offsets, cursor + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_pack_unpack_roundtrip(dtype):
    gen = torch.Generator().manual_seed(1)
    sizes = SIZES + [3, 2**21 + 1]
    tensors = [(torch.randn(n, generator=gen) * 50 + 1).to(dtype) for n in sizes]
    tensors[3] = tensors[3].reshape(4, 4)  # shapes do not matter, only element counts
    offsets, total = _layout([t.numel() for t in tensors], gen)
    flat = torch.full((total,), 77, dtype=dtype)  # poison: every gap must become 0
    ops.pack(tensors, offsets, flat)
    want = torch.empty_like(flat)
    pack_reference(tensors, offsets, want)
    assert torch.equal(flat, want)
    back = [torch.full_like(t, 3) for t in tensors]
    ops.unpack(flat, back, offsets)
    for a, b in zip(back, tensors):
        assert torch.equal(a, b)


def test_pack_order_does_not_matter():
    ts = [torch.arange(5.0) + 1, torch.arange(3.0) + 10]
    flat = torch.full((12,), -1.0)
    ops.pack(ts, [7, 1], flat)
    assert flat.tolist() == [0, 10, 11, 12, 0, 0, 0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("tensors, offsets, exc, words", [
    ([torch.ones(4), torch.ones(4)], [0, 2], ValueError, "overlap"),
    ([torch.ones(4)], [8], ValueError, r"'tensors\[0\]' with 4 elements at offset 8 does not fit"),
    ([torch.ones(4)], [-1], ValueError, "does not fit"),
    ([torch.ones(4, dtype=torch.float64)], [0], TypeError, r"'tensors\[0\]' has dtype float64"),
    ([torch.ones(4, 2)[:, 0]], [0], ValueError, r"'tensors\[0\]' must be contiguous"),
    ([torch.ones(4, device="meta")], [0], ValueError, r"'tensors\[0\]' is on meta"),
    ([torch.ones(4)], [0, 1], ValueError, "1 tensors but 2 offsets"),
])
def test_pack_errors(tensors, offsets, exc, words):
    with pytest.raises(exc, match=words):
        ops.pack(tensors, offsets, torch.zeros(10))


def test_unpack_destinations_sharing_memory_are_refused_on_the_fast_path_too():
    """unpack's fast path (no per-tensor Python checks) still refuses destinations that overlap each
    other, naming both, and writes nothing."""
    base = torch.zeros(10)
    flat = torch.arange(20.0)
    for dests in ([base[:4], base[2:6]], [base[2:6], base[:4]], [base, base[9:]]):
        with pytest.raises(ValueError, match=r"'tensors\[0\]' and 'tensors\[1\]' share memory"):
            ops.unpack(flat, dests, [0, 10])
        assert torch.equal(base, torch.zeros(10))
    apart = [base[:4], base[4:8]]  # adjacent is fine
    ops.unpack(flat, apart, [0, 10])
    assert base[:8].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]


def test_unpack_takes_the_fast_path_for_a_usual_bucket(monkeypatch):
    """A bucket of ascending, in-bounds, separate tensors is checked without the per-tensor checks
    (they cost more than a GPU's copy of a 200-tensor bucket)."""
    from zerocore.ops import _checks

    calls = []
    monkeypatch.setattr(_checks, "check_tensor", lambda *a, **k: calls.append(a))
    tensors = [torch.zeros(n) for n in (3, 1, 5)]
    checked, offs = _checks.pack_args("unpack", tensors, [0, 3, 4], torch.ones(9), cuda=False)
    assert calls == [] and offs == [0, 3, 4] and all(a is b for a, b in zip(checked, tensors))
