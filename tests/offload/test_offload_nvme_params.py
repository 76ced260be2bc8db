"""Stage-3 parameter shards beyond offload_param.max_in_cpu on NVMe (issue 13).

The swapped shards hold the same bytes the CPU parameter offload keeps in host memory, so every
run must equal the CPU-offload twin bit for bit (losses, norms, weights) and match single-process
torch.optim.AdamW with test_stages.py's tolerances. Also: host parameter bytes bounded by
max_in_cpu plus the buffers (counted from the tensors held); a flipped byte or a truncated
parameter swap file gives an error naming the file, offset and step with nothing changed, and
training goes on once the file is repaired; a full or read-only disk (the writer hook) is a clear
error, no hang; the start-up space check counts the parameter swap files; checkpoints round trip
bit for bit; the swap folder is removed at exit.
"""
from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import torch

import zerocore
from disk_faults import fail_writes
from dist_helpers import case_results, run_case
from test_offload import CLIP, SIZE, assert_same_bits
from test_offload_nvme import SWAP, NvmeCase, nvme, spawn_with_twins
from test_stages import check_against_reference
from transfer_trace import trace_gathers, trace_param_swap
from zerocore import ops
from zerocore.config import ConfigError
from zerocore.offload.nvme import SwapCorruptError, SwapError
from zerocore.offload.nvme import params as params_mod
from zerocore.offload.nvme.records import param_record_bytes

pytestmark = pytest.mark.skipif(ops.aio.aio_unavailable() is not None, reason="no NVMe I/O engine in this build")


@dataclasses.dataclass
class ParamCase(NvmeCase):
    """An NVMe case whose parameter shards mostly rest on NVMe (``in_cpu`` elements in host memory)."""

    in_cpu: int = 0
    par_buffers: int = 3

    def config(self) -> dict:
        cfg = super().config()
        if self.cpu_twin:
            return cfg
        colossal = self.form == "colossal"
        par = cfg["zero" if colossal else "zero_optimization"]["offload_param_config" if colossal else "offload_param"]
        par["max_in_cpu"] = self.in_cpu
        if not colossal:  # ColossalAI's dict names only max_in_cpu (buffer_count: its default, 5)
            par.update(buffer_count=self.par_buffers, buffer_size=1_000_000)
        return cfg


def swapped(name, model, *, in_cpu=0, par_buffers=3, **kw) -> ParamCase:
    base = nvme(name, model, 3, **kw)
    return ParamCase(**{f.name: getattr(base, f.name) for f in dataclasses.fields(NvmeCase)}, in_cpu=in_cpu,
                     par_buffers=par_buffers)


W2 = [
    swapped("p_fp32_acc2_clip_seed", "nested", form="colossal", in_cpu=2000, zero=dict(SIZE, **SWAP), **CLIP),
    swapped("p_bf16_ds", "gpt", dtype="bf16", lr=3e-3, par_buffers=2,
            zero={"stage3_unit_classes": ["Block"], **SIZE, **SWAP}),
    swapped("p_fp32_acc2_clip_ds_all_swapped", "gpt", zero=dict(SIZE, **SWAP), **CLIP),
]
W4 = [swapped("p_bf16_acc2_clip_ds", "gpt", dtype="bf16", lr=3e-3, gas=2, clip=0.05, in_cpu=3000,
              zero=dict(SIZE, **SWAP))]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_with_twins(W2, 2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn_with_twins(W4, 4, tmp_path_factory)


def check_case(case, world, cases, results):
    got = case_results(results, cases, case.name)
    check_against_reference(case, world, got)
    twin = case_results(results, cases, case.name + "__cpu")
    assert_same_bits(got, twin)
    for r, t in zip(got, twin):  # the swapped shards are not held: only the buffers (and max_in_cpu's)
        assert 0 < r["memory"]["host_params"]
        assert r["memory"]["host_master"] == 0


@pytest.mark.parametrize("case", W2, ids=lambda c: c.name)
def test_world2_param_shards_on_nvme_match_adamw_and_the_cpu_offload_run_bit_for_bit(world2, case):
    check_case(case, 2, *world2[:2])


@pytest.mark.parametrize("case", W4, ids=lambda c: c.name)
def test_world4_param_shards_on_nvme_match_adamw_and_the_cpu_offload_run_bit_for_bit(world4, case):
    check_case(case, 4, *world4[:2])


def test_world1_param_shards_on_nvme_match_adamw_and_the_cpu_offload_run_bit_for_bit(tmp_path):
    case = swapped("w1_fp32_acc2_clip", "gpt", par_buffers=2, zero=dict(SIZE, **SWAP), steps=4, **CLIP)
    got = run_case(dataclasses.replace(case, nvme_path=str(tmp_path)), 0, 1)
    check_against_reference(case, 1, [got])
    assert_same_bits([got], [run_case(dataclasses.replace(case, cpu_twin=True), 0, 1)])


def test_swap_files_removed_at_normal_exit(world2, world4):
    assert world2[2] == [] and world4[2] == []


# -- one process --------------------------------------------------------------------------------
D = 256
GROUP = D * D + D  # one Linear per stage-3 unit: elements of each group's shard at world 1


def deep(n=5):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(n)])


def cfg_for(path, *, params="nvme", opt="cpu", in_cpu=GROUP, buffers=2, dtype=None) -> dict:
    off = {"device": opt}
    if opt == "nvme":
        off.update(nvme_path=str(path), buffer_count=2, pipeline_read=True, pipeline_write=True)
    par = {"device": params}
    if params == "nvme":
        par.update(nvme_path=str(path), buffer_count=buffers, buffer_size=100_000, max_in_cpu=in_cpu)
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": par, "sub_group_size": 4096,
                                 **SIZE},
           "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if dtype is not None:
        cfg[dtype] = {"enabled": True}
    return cfg


def train(engine, steps, seed=0):
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        x, y = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def weights(engine):
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def run(path, steps, **kw):
    engine = zerocore.initialize(deep(), cfg_for(path, **kw))
    try:
        return train(engine, steps), weights(engine)
    finally:
        engine.destroy()


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_host_param_bytes_are_bounded_by_max_in_cpu_and_the_buffers(tmp_path, monkeypatch, dtype):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, dtype=dtype, opt="nvme"))
    swap = engine.offload.param_swap
    trace = trace_param_swap(monkeypatch, swap)
    losses = train(engine, 3)
    mem = engine.memory_report()
    size = engine.dtype.itemsize
    slot = param_record_bytes(GROUP, engine.dtype)
    assert swap.pool.numel() == 2 * slot and len(swap.groups) == 4  # 4 of 5 groups swapped, 2 buffers
    assert mem["host_params"] <= GROUP * size + swap.pool.numel()  # max_in_cpu's bytes + the buffers
    assert mem["host_params"] == GROUP * size + swap.pool.numel()  # (counted from the tensors held)
    assert mem["host_master"] == mem["master"] == mem["params"] == 0
    assert 4 * GROUP * size > 1.5 * swap.pool.numel()  # the swapped shards do not fit in the buffers
    reads = [gi for op, gi in trace if op == "read"]
    assert len(reads) >= 3  # the buffers cycle: swapped shards are read back
    for gi, sw in swap.groups.items():  # two slots per swapped group
        assert os.path.getsize(sw.path) == 2 * slot
    engine.destroy()
    cpu_losses, cpu_w = run(tmp_path, 3, params="cpu", opt="nvme", dtype=dtype)
    nv_losses, nv_w = run(tmp_path, 3, opt="nvme", dtype=dtype)
    assert losses == cpu_losses == nv_losses
    for k in cpu_w:
        assert torch.equal(cpu_w[k], nv_w[k]), k


@pytest.mark.parametrize("buffers", [3, 5])
def test_a_step_reads_only_what_the_buffers_cannot_keep_and_reads_it_ahead(tmp_path, monkeypatch, buffers):
    """5 swapped groups. The host step writes each shard without reading it and leaves it in its
    buffer for the next forward: with a buffer per group nothing is read in a steady step; with 3,
    a few shards are, some of them ahead of their gathers (the order recorded in the last step)."""
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, in_cpu=0, buffers=buffers))
    swap = engine.offload.param_swap
    assert len(swap.groups) == 5
    train(engine, 2)
    for _s in engine.offload.shards.values():
        _s.ready.wait()  # the last step's host steps (and their writes) are done
    trace = trace_param_swap(monkeypatch, swap)
    trace_gathers(monkeypatch, swap, trace)
    train(engine, 1, seed=7)
    for _s in engine.offload.shards.values():
        _s.ready.wait()
    reads = [i for i, (op, _) in enumerate(trace) if op == "read"]
    assert sorted(gi for op, gi in trace if op == "write") == sorted(swap.groups)
    if buffers == 5:
        assert reads == [], trace
        return
    gathers = sum(op == "gather" for op, _ in trace)
    assert gathers == 10 and 0 < len(reads) < gathers, trace  # fewer than one per gather (how few: timing)
    ahead = [i for i in reads if ("gather", trace[i][1]) in trace[i + 1:]
             and trace[i - 1] != ("gather", trace[i][1])]
    assert ahead, trace


def _current_slot_offset(sw) -> int:
    return (sw.commit % 2) * param_record_bytes(sw.n, sw.group.layout.dtype)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_param_swap_file_names_file_offset_step_changes_nothing_and_repaired_goes_on(tmp_path, how):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path))
    clean = zerocore.initialize(deep(), cfg_for(tmp_path))
    assert train(engine, 2) == train(clean, 2)
    for _s in engine.offload.shards.values():
        _s.ready.wait()
    swap = engine.offload.param_swap
    swap.flush()  # nothing resident: the next forward reads every swapped shard
    gi = min(swap.groups)
    sw = swap.groups[gi]
    off = _current_slot_offset(sw)
    with open(sw.path, "rb") as f:
        original = f.read()
    masters = {k: s.master.clone() for k, s in engine.offload.shards.items()}
    commit = sw.commit
    if how == "flip":
        with open(sw.path, "r+b") as f:
            f.seek(off + 4096 + 100)
            b = f.read(1)
            f.seek(off + 4096 + 100)
            f.write(bytes([b[0] ^ 0x40]))
    else:
        os.truncate(sw.path, off + 4096 + 10)
    with pytest.raises(SwapError) as info:
        train(engine, 1, seed=2)
    text = str(info.value)
    assert isinstance(info.value, SwapCorruptError if how == "flip" else SwapError)
    assert sw.path in text and f"offset {off}" in text and "step 2" in text and "Nothing was changed" in text
    assert ("checksum" if how == "flip" else "truncated") in text
    assert engine.optimizer_steps == 2 and sw.commit == commit
    for k, s in engine.offload.shards.items():  # no optimizer state changed
        assert torch.equal(s.master, masters[k]), k
    with open(sw.path, "wb") as f:  # repaired: training goes on as the clean run
        f.write(original)
    engine.zero_grad()
    assert train(engine, 2, seed=2) == train(clean, 2, seed=2)
    a, b = weights(engine), weights(clean)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("code,said", [(errno.ENOSPC, "the disk is full"),
                                       (errno.EROFS, "the file system is read-only")])
def test_param_write_failure_is_a_clear_error_without_hang(tmp_path, code, said):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path))
    train(engine, 1)
    fail_writes(engine.offload.param_swap.store, code)
    with pytest.raises((SwapError, RuntimeError)) as info:
        train(engine, 2, seed=3)
        for _s in engine.offload.shards.values():
            _s.ready.wait()
    err = info.value if isinstance(info.value, SwapError) else info.value.__cause__
    assert isinstance(err, SwapError), info.value
    assert "write of parameter shard swap" in str(err) and said in str(err) and "params" in str(err)


def test_start_up_space_check_counts_the_parameter_swap_files(tmp_path, monkeypatch):
    monkeypatch.setattr(params_mod, "free_bytes", lambda path: 3 * param_record_bytes(GROUP, torch.float32))
    with pytest.raises(ConfigError, match="zero_optimization.offload_param.nvme_path: .* has [0-9]+ bytes free; "
                                          "the swap files need [0-9]+ bytes .*parameter shards"):
        zerocore.initialize(deep(), cfg_for(tmp_path))


def test_shard_larger_than_buffer_size_is_named(tmp_path):
    cfg = cfg_for(tmp_path)
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = 1000
    with pytest.raises(ConfigError, match="offload_param.buffer_size: 1000 elements is smaller than group 1's"):
        zerocore.initialize(deep(), cfg)


def test_param_swap_folder_removed_at_exit(tmp_path):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path))
    train(engine, 1)
    folder = engine.offload.param_swap.store.dir
    assert sorted(os.listdir(folder)) == ["owner.json"] + [f"params{i}.swap" for i in range(1, 5)]
    engine.offload.param_swap.close()  # what interpreter exit runs (the spawned ranks above leave no files)
    assert not os.path.exists(folder)


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
def test_checkpoint_round_trip_with_param_shards_on_nvme_goes_on_bit_for_bit(tmp_path, opt):
    ck = tmp_path / "ckpt"
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, opt=opt, dtype="bf16"))
    train(engine, 2)
    engine.save_checkpoint(str(ck))
    after = train(engine, 2, seed=2)
    want = weights(engine)
    engine.destroy()
    again = zerocore.initialize(deep(), cfg_for(tmp_path, opt=opt, dtype="bf16"))
    path, _ = again.load_checkpoint(str(ck))
    assert path is not None
    again.offload.param_swap.flush()  # the loaded shards read back from their files
    assert train(again, 2, seed=2) == after
    got = weights(again)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_an_edit_under_gathered_reaches_the_swapped_shard_and_the_master(tmp_path):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, in_cpu=0, dtype="bf16"))
    train(engine, 1)
    w = engine.module[2][0].weight
    gi, _ = engine.param_index[id(w)]
    with zerocore.gathered([w], modifier_rank=0):
        with torch.no_grad():
            w.fill_(0.5)
    swap = engine.offload.param_swap
    swap.flush()  # written back, read again below
    assert swap.groups[gi].buffer is None
    n = w.numel()
    assert torch.equal(engine.groups[gi].owned_params()[:n], torch.full((n,), 0.5, dtype=torch.bfloat16))
    assert torch.equal(engine.offload.shards[gi].master[:n], torch.full((n,), 0.5))


@pytest.mark.parametrize("opt", ["cpu", "nvme"])
def test_the_host_step_writes_swapped_shards_without_reading_them(tmp_path, monkeypatch, opt):
    """The step writes every element of a shard (its 16-bit values come from the master): a shard
    not resident is not read for it, only written back."""
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, in_cpu=0, opt=opt, dtype="bf16"))
    train(engine, 1)
    swap = engine.offload.param_swap
    x = torch.randn(2, D).bfloat16()
    engine.backward(engine(x).float().pow(2).mean())
    swap.flush()
    trace = trace_param_swap(monkeypatch, swap)
    engine.step()
    for _s in engine.offload.shards.values():
        _s.ready.wait()
    assert sorted(trace) == [("write", gi) for gi in sorted(swap.groups)]
    clean = zerocore.initialize(deep(), cfg_for(tmp_path, params="cpu", opt=opt, dtype="bf16"))
    train(clean, 1)
    clean.backward(clean(x).float().pow(2).mean())
    clean.step()
    a, b = weights(engine), weights(clean)
    for k in a:
        assert torch.equal(a[k], b[k]), k
