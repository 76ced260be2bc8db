"""NVMe offload of the optimizer state (zero_optimization.offload_optimizer.device nvme, issue 13).

The swap files hold the same bytes the CPU offload keeps in host memory, so every run must equal
the CPU-offload run of the same config bit for bit (losses, norms, weights), and match
single-process torch.optim.AdamW with test_stages.py's tolerances. Also: host memory for the
state bounded by the pinned buffers; corrupt, truncated, unwritable swap files and a full disk
give an error naming the file, offset and step with nothing changed; start-up checks of
nvme_path; swap files removed at exit; both I/O backends give identical results.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os

import pytest
import torch

import zerocore
from disk_faults import fail_writes, heal_writes
from dist_helpers import case_results, run_case, spawn_cases
from test_offload import CLIP, SIZE, OffCase, assert_same_bits, offloaded
from test_stages import check_against_reference
from transfer_trace import trace_store
from zerocore import ops
from zerocore.config import ConfigError
from zerocore.offload.nvme import NvmeOptimizerShard, SwapCorruptError, SwapError, store as store_mod
from zerocore.offload.nvme import checks as checks_mod, plan as plan_mod, records

pytestmark = pytest.mark.skipif(ops.aio.aio_unavailable() is not None, reason="no NVMe I/O engine in this build")
# several tiles per group and a buffer pool smaller than a group: the pipeline really cycles
SWAP = {"sub_group_size": 1024}


@dataclasses.dataclass
class NvmeCase(OffCase):
    nvme_path: str = ""
    buffer_count: int = 3
    pipelined: bool = True
    cpu_twin: bool = False  # the same config with device cpu (the bit-for-bit reference)

    def config(self) -> dict:
        cfg = super().config()
        if self.cpu_twin:
            return cfg
        z = cfg["zero" if self.form == "colossal" else "zero_optimization"]
        key = "offload_optimizer_config" if self.form == "colossal" else "offload_optimizer"
        if self.form == "colossal":  # ColossalAI's NVMe dicts
            z[key] = dict(device="nvme", pin_memory=True, fast_init=True, nvme_path=self.nvme_path)
            if self.params:
                z["offload_param_config"] = dict(device="nvme", pin_memory=True, max_in_cpu=10_000_000,
                                                 nvme_path=self.nvme_path)
        else:  # DeepSpeed's sections
            z[key] = dict(z[key], device="nvme", nvme_path=self.nvme_path, buffer_count=self.buffer_count,
                          pipeline_read=self.pipelined, pipeline_write=self.pipelined, fast_init=True)
            if self.params:
                z["offload_param"] = dict(device="nvme", nvme_path=self.nvme_path, buffer_count=5,
                                          buffer_size=1_000_000, max_in_cpu=10_000_000)
            cfg["aio"] = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 1}
        return cfg


def nvme(name, model, stage, buffer_count=3, pipelined=True, **kw) -> NvmeCase:
    off = offloaded(name, model, stage, **kw)
    return NvmeCase(**{f.name: getattr(off, f.name) for f in dataclasses.fields(OffCase)},
                    buffer_count=buffer_count, pipelined=pipelined)


W2_NVME = [
    nvme("s1_fp32_acc2_clip_ds", "gpt", 1, bucket=6000, overlap=True, zero=SWAP, **CLIP),
    nvme("s2_bf16_seed", "gpt", 2, form="colossal", dtype="bf16", lr=3e-3, bucket=6000, zero=SWAP),
    nvme("s2_fp32_unpipelined_one_buffer", "mlp_frozen_unused", 2, bucket=700, zero=SWAP, buffer_count=1,
         pipelined=False, **CLIP),
    nvme("s3_fp32_acc2_clip_seed_params", "nested", 3, form="colossal", zero=dict(SIZE, **SWAP), **CLIP),
    nvme("s3_bf16_ds_params", "gpt", 3, dtype="bf16", lr=3e-3, zero={"stage3_unit_classes": ["Block"], **SWAP}),
    # an Inf on one rank at step 1: skipped on every rank, the swap files untouched, training goes on
    nvme("s2_fp16_overflow", "mlp", 2, dtype="fp16", lr=3e-3, bucket=2000, zero=SWAP, inject_inf=(1, 0),
         fp16={"initial_scale_power": 10}),
]
W4_NVME = [nvme("s2_bf16_acc2_clip_ds", "gpt", 2, dtype="bf16", lr=3e-3, bucket=6000, gas=2, clip=0.05, zero=SWAP)]


def spawn_with_twins(cases, world, tmp_path_factory):
    """``cases`` with their swap folder, each followed by its CPU-offload twin; also the swap files left."""
    swap = tmp_path_factory.mktemp(f"nvme_swap_w{world}")
    out = []
    for c in cases:
        out += [dataclasses.replace(c, nvme_path=str(swap)),
                dataclasses.replace(c, name=c.name + "__cpu", cpu_twin=True)]
    results = spawn_cases(out, world, tmp_path_factory.mktemp(f"nvme_w{world}"), timeout=300)
    return out, results, [p for p, _, files in os.walk(swap) if files]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_with_twins(W2_NVME, 2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn_with_twins(W4_NVME, 4, tmp_path_factory)


def check_case(case, world, cases, results):
    got = case_results(results, cases, case.name)
    check_against_reference(case, world, got)
    assert_same_bits(got, case_results(results, cases, case.name + "__cpu"))
    if case.inject_inf is not None:
        assert got[0]["skipped"][-1] == 1
    for r in got:  # the state is in the swap files: no host master/m/v, only the pinned buffers
        mem = r["memory"]
        assert mem["host_master"] == mem["host_exp_avg"] == mem["host_exp_avg_sq"] == 0
        assert mem["master"] == mem["exp_avg"] == mem["exp_avg_sq"] == 0 and mem["host_swap"] > 0


@pytest.mark.parametrize("case", W2_NVME, ids=lambda c: c.name)
def test_world2_nvme_matches_adamw_and_the_cpu_offload_run_bit_for_bit(world2, case):
    check_case(case, 2, *world2[:2])


@pytest.mark.parametrize("case", W4_NVME, ids=lambda c: c.name)
def test_world4_nvme_matches_adamw_and_the_cpu_offload_run_bit_for_bit(world4, case):
    check_case(case, 4, *world4[:2])


def test_world1_nvme_matches_adamw_and_the_cpu_offload_run_bit_for_bit(tmp_path):
    case = nvme("w1_s3_fp32_acc2_clip_params", "gpt", 3, zero=dict(SIZE, **SWAP), steps=4, **CLIP)
    got = run_case(dataclasses.replace(case, nvme_path=str(tmp_path)), 0, 1)
    check_against_reference(case, 1, [got])
    assert_same_bits([got], [run_case(dataclasses.replace(case, cpu_twin=True), 0, 1)])


def test_swap_files_removed_at_normal_exit(world2, world4):
    assert world2[2] == [] and world4[2] == []


# -- one process --------------------------------------------------------------------------------
def deep(n=4, d=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(n)])


def cfg_for(path, stage=2, *, device="nvme", buffers=2, tile=4096, **extra):
    off = {"device": device}
    if device == "nvme":
        off.update(nvme_path=str(path), buffer_count=buffers, pipeline_read=True, pipeline_write=True)
    z = {"stage": stage, "offload_optimizer": off, "sub_group_size": tile, "reduce_bucket_size": 100_000,
         **(SIZE if stage == 3 else {}), **extra}
    return {"zero_optimization": z, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def train(engine, steps, seed=0):
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        x, y = torch.randn(2, 256, generator=g), torch.randn(2, 256, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def swap_files(engine):
    return {s.path: s for s in engine.offload.shards.values()}


def weights(engine):
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def owned_params(engine):
    """Every group's owned parameters as they are (no wait: a failed host step leaves them)."""
    return {g.index: g.owned_params_raw().clone() for g in engine.groups}


def test_host_memory_is_bounded_by_the_buffers_and_files_have_their_size(tmp_path):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, buffers=2, tile=4096))
    train(engine, 2)
    mem = engine.memory_report()
    owned = sum(g.hi - g.lo for g in engine.groups)
    pool = engine.offload.nvme.store.pool
    assert mem["host_swap"] == pool.numel() == 2 * (4096 + 3 * 4 * 4096)  # two records of a 4096-element tile
    assert 12 * owned >= 4 * mem["host_swap"]  # the state is >= 4x the buffers ...
    assert mem["host_master"] == mem["host_exp_avg"] == mem["host_exp_avg_sq"] == 0  # ... and only they are held
    for path, shard in swap_files(engine).items():
        assert os.path.getsize(path) == NvmeOptimizerShard.size_on_disk(shard.n, 4096) == 2 * len(shard.tiles) * (
            4096 + 3 * 4 * 4096)
    cpu = zerocore.initialize(deep(), cfg_for(tmp_path, device="cpu"))
    assert train(cpu, 2) == engine_losses(tmp_path, 2)


def test_default_sub_group_size_gives_bounded_nvme_tiles(tmp_path):
    cfg = cfg_for(tmp_path)
    del cfg["zero_optimization"]["sub_group_size"]  # DeepSpeed's 1e9 default would mean 12 GB buffers
    engine = zerocore.initialize(deep(1), cfg)
    assert engine.offload.nvme.opts.tile == plan_mod.NVME_TILE == 1 << 24
    assert plan_mod.DEFAULT_SUB_GROUP == 1_000_000_000


def engine_losses(path, steps, **kw):
    return train(zerocore.initialize(deep(), cfg_for(path, **kw)), steps)


def test_state_tiles_stream_and_write_back(tmp_path):
    engine = zerocore.initialize(deep(2), cfg_for(tmp_path, tile=2048))
    cpu = zerocore.initialize(deep(2), cfg_for(tmp_path, device="cpu"))
    train(engine, 2)
    train(cpu, 2)
    for a, b in zip(engine.offload.shards.values(), cpu.offload.shards.values()):
        got = [(lo, hi, {k: t.clone() for k, t in d.items()}) for lo, hi, d in a.state_tiles(1000)]
        want = [(lo, hi, d) for lo, hi, d in b.state_tiles(1000)]
        assert all(hi - lo <= 1000 for lo, hi, _ in got) and got[-1][1] == want[-1][1] == a.n
        for role in ("master", "exp_avg", "exp_avg_sq"):  # tiles cut differently, the same state
            assert torch.equal(torch.cat([d[role] for _, _, d in got]), torch.cat([d[role] for _, _, d in want]))
        for lo, hi, d in a.state_tiles(1000, write=True):  # a checkpoint load writes through the views
            d["exp_avg"].fill_(lo)
        assert all(torch.all(d["exp_avg"] == lo) for lo, hi, d in a.state_tiles(1000))
        a.load_master(3, 7, torch.arange(4.0))
        assert torch.equal(a.master[3:7], torch.arange(4.0))


@pytest.mark.parametrize("algo", sorted(records.CHECKSUMS))
def test_every_checksum_catches_a_flipped_bit_and_a_foreign_record(monkeypatch, algo):
    monkeypatch.setattr(records, "ALGO", algo)
    rec = records.Record(ops.aligned_pinned_empty(records.record_bytes(3000), dtype=torch.uint8), 3000)
    rec.master.normal_()
    rec.seal("run1", 0, 2, 5, 7, 3000)
    ok = {"run": "run1", "rank": 0, "group": 2, "tile": 5, "commit": 7, "elements": 3000}
    rec.verify(ok, "f")
    with pytest.raises(SwapCorruptError, match="f: record commit is 7, expected 8"):  # a lost write
        rec.verify(dict(ok, commit=8), "f")
    with pytest.raises(SwapCorruptError, match="f: record run is 'run1', expected 'run2'"):  # another run's file
        rec.verify(dict(ok, run="run2"), "f")
    rec.exp_avg_sq[2999] = 1.0  # one bit pattern changed in the payload's last element
    with pytest.raises(SwapCorruptError, match=f"f: checksum mismatch \\({records.CHECKSUMS[algo][0]} "):
        rec.verify(ok, "f")


def test_the_swap_pipeline_reads_ahead_and_writes_behind(tmp_path, monkeypatch):
    """buffer_count 3, pipeline_read/write: tile k+1's read is issued before tile k is used, and
    tile k-1's write is still in flight while tile k is used (its lane is not waited for)."""
    engine = zerocore.initialize(deep(1), cfg_for(tmp_path, buffers=3, tile=1024))
    train(engine, 1)
    shard = engine.offload.shards[0]
    store = engine.offload.nvme.store
    trace = trace_store(monkeypatch, store)
    n_tiles = len(shard.tiles)
    assert n_tiles >= 8
    for lo, hi, d in shard.state_tiles(1 << 30, write=True):
        trace.append(("use", lo // shard.tile, None))
    trace = list(trace)  # what the pass did (nothing after it is recorded)
    at = {(op, x): i for i, (op, lane, off) in enumerate(trace)
          for x in [off // (2 * shard.rec_bytes) if off is not None else lane]}
    uses = [i for i, (op, _, _) in enumerate(trace) if op == "use"]
    assert len(uses) == n_tiles
    for k in range(1, n_tiles):
        assert at[("read", k)] < uses[k - 1], f"tile {k} was not read ahead"
        # between tile k-1's write and tile k's use, nobody waits for tile k-1's lane
        w = next(i for i, (op, _, off) in enumerate(trace) if op == "write" and off // (2 * shard.rec_bytes) == k - 1)
        lane = trace[w][1]  # (the lane follows the store's running tile sequence)
        assert not [e for e in trace[w:uses[k]] if e[0] == "wait_write" and e[1] in (lane, None)], k
    assert shard.commit == 2  # the pass committed (one step + this write-back)


def _corrupt_first_record(path, how):
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(4096 + 100)  # a payload byte of tile 0's current slot
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0x40]))
    else:
        os.truncate(path, 4096 + 10)


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("stage", [2, 3])
def test_corrupt_swap_file_raises_naming_file_offset_step_and_changes_nothing(tmp_path, how, stage):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path, stage))
    train(engine, 2)
    for _s in engine.offload.shards.values():
        _s.ready.wait()
    before = owned_params(engine)
    shard = engine.offload.shards[0]  # the group stepped first at stage 2
    path = shard.path
    _corrupt_first_record(path, how)
    with pytest.raises((SwapError, RuntimeError)) as info:
        train(engine, 1, seed=5)
        for _s in engine.offload.shards.values():
            _s.ready.wait()  # stage 3: the worker's error surfaces at the next wait
    err = info.value if isinstance(info.value, SwapError) else info.value.__cause__
    assert isinstance(err, SwapCorruptError if how == "flip" else SwapError), info.value
    text = str(err)
    assert path in text and "offset 0" in text and "step 3" in text and "Nothing was changed" in text
    if how == "flip":
        assert "checksum" in text
    else:
        assert "truncated" in text
    # the failed group's parameters (and state: the old slot, still committed) are as they were; at stage 2
    # the first group stepped fails before any other steps, so no parameter of the model changed. (At stage 3
    # the other groups' host steps run independently on the worker: those that were fine did step.)
    after = owned_params(engine)
    for k in before if stage == 2 else [0]:
        assert torch.equal(before[k], after[k]), k
    assert shard.commit == 2 and all(s.commit == 2 for s in engine.offload.shards.values()) or stage == 3


@pytest.mark.parametrize("code,said", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "the file system is read-only")])
def test_write_failure_is_a_clear_error_and_changes_nothing(tmp_path, code, said):
    """A full disk / read-only file system (injected in the writer: no small file system can be
    mounted here, and root ignores chmod): the step raises, nothing changes, no hang; the committed
    state still reads back verified."""
    engine = zerocore.initialize(deep(), cfg_for(tmp_path))
    train(engine, 2)
    before = weights(engine)
    masters_before = engine.offload.shards[0].master
    fail_writes(engine.offload.nvme.store, code)
    with pytest.raises(SwapError, match=f"write of optimizer state swap .* failed at step 3 \\({said}"):
        train(engine, 1, seed=2)
    for k, v in weights(engine).items():
        assert torch.equal(before[k], v), k
    heal_writes(engine.offload.nvme.store)  # the disk has room again: the committed state reads back
    assert torch.equal(engine.offload.shards[0].master, masters_before)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files anyway")
def test_read_only_swap_folder_mid_run_is_a_clear_error(tmp_path):
    engine = zerocore.initialize(deep(), cfg_for(tmp_path))
    train(engine, 1)
    for path in swap_files(engine):
        os.chmod(path, 0o444)
    with pytest.raises(SwapError, match="permission denied"):
        train(engine, 1)


def test_backends_give_identical_results(tmp_path, monkeypatch):
    usable = [b for b, why in ops.aio.available_backends().items() if why is None]
    orig = store_mod.config_to_kwargs
    runs = []
    for backend in usable:
        monkeypatch.setattr(store_mod, "config_to_kwargs", lambda a, b=backend: dict(orig(a), backend=b))
        engine = zerocore.initialize(deep(), cfg_for(tmp_path, stage=3))
        assert engine.offload.nvme.store.reader.backend == backend
        runs.append((train(engine, 3), weights(engine)))
    for losses, w in runs[1:]:
        assert losses == runs[0][0] and all(torch.equal(w[k], runs[0][1][k]) for k in w)


def test_swap_folder_removed_at_exit_and_leftovers_of_a_crashed_run_never_read(tmp_path, caplog):
    crashed = tmp_path / "zerocore_swap" / "deadbeef" / "rank0"
    crashed.mkdir(parents=True)
    (crashed / "owner.json").write_text(json.dumps({"run": "deadbeef", "pid": 2 ** 22 + 7, "host": os.uname()[1]}))
    (crashed / "group0.swap").write_bytes(b"\0" * 8192)
    with caplog.at_level(logging.WARNING, logger="zerocore.offload"):
        engine = zerocore.initialize(deep(), cfg_for(tmp_path))
    assert "deadbeef" in caplog.text and "never read" in caplog.text
    folder = engine.offload.nvme.store.dir
    assert "deadbeef" not in folder and os.path.isdir(folder)
    train(engine, 1)
    engine.offload.nvme.close()  # what interpreter exit runs (world2: the spawned ranks leave no files)
    assert not os.path.exists(folder) and os.listdir(tmp_path / "zerocore_swap") == ["deadbeef"]


def test_nvme_path_checks_at_initialize(tmp_path, monkeypatch):
    key = "zero_optimization.offload_optimizer.nvme_path"
    for path, said in [(tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory")]:
        if "file" in str(path):
            path.write_text("x")
        with pytest.raises(ConfigError, match=f"{key}: '{path}' {said}"):
            zerocore.initialize(deep(), cfg_for(path))

    def refuse(path):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(checks_mod, "open_direct", refuse)
    with pytest.raises(ConfigError, match=f"{key}: the file system of '{tmp_path}' does not support O_DIRECT"):
        zerocore.initialize(deep(), cfg_for(tmp_path))
    monkeypatch.undo()
    monkeypatch.setattr(plan_mod, "free_bytes", lambda p: 100_000)
    with pytest.raises(ConfigError, match=rf"{key}: '{tmp_path}' has 100000 bytes free; the swap files need \d+ bytes"):
        zerocore.initialize(deep(), cfg_for(tmp_path))
    with pytest.raises(ConfigError, match="offload_optimizer.ratio: 0.5 with device 'nvme'"):
        zerocore.initialize(deep(), cfg_for(tmp_path, offload_optimizer={"device": "nvme", "ratio": 0.5,
                                                                           "nvme_path": str(tmp_path)}))


def test_stages_1_2_read_the_first_tiles_during_backward(tmp_path, monkeypatch):
    """The step at stages 1/2 is synchronous and begins with the first group's first tiles: they
    are read when that group's gradient lands in the boundary backward, and the step does not read
    them again (its results are the CPU-offload twin's: the world-2 tests above)."""
    engine = zerocore.initialize(deep(2), cfg_for(tmp_path, buffers=3, tile=1024))
    train(engine, 1)
    first = engine.offload.shards[min(engine.offload.shards)]
    store = engine.offload.nvme.store
    trace = trace_store(monkeypatch, store)
    x, y = torch.randn(2, 256), torch.randn(2, 256)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    slot = first.commit % 2
    early = [off for op, _, off in trace if op == "read"]
    assert early == [(2 * k + slot) * first.rec_bytes for k in range(3)]  # buffer_count tiles, before step()
    trace.clear()
    engine.step()
    reads = [off for op, _, off in trace if op == "read"]
    n = len(first.tiles)
    assert n > 3 and reads[:n - 3] == [(2 * k + slot) * first.rec_bytes for k in range(3, n)]  # on from tile 3
    assert first.commit == 2 and engine.optimizer_steps == 2


@pytest.mark.parametrize("stage", [2, 3])
def test_the_next_group_is_read_while_this_one_is_stepped(tmp_path, monkeypatch, stage):
    """One tile per group: the pass over group k issues the read of the next group's first tile
    (stage 3: next in the worker's order; stages 1/2: in index order) before group k's Adam
    completes, and that pass does not read it again; the results are the unpipelined run's (the
    world-2/4 bit-for-bit tests)."""
    from zerocore.offload.nvme import shard as shard_mod

    engine = zerocore.initialize(deep(4), cfg_for(tmp_path, stage=stage, buffers=3, tile=1 << 20))
    train(engine, 1)
    for _s in engine.offload.shards.values():
        _s.ready.wait()
    store = engine.offload.nvme.store
    paths = {s.path: gi for gi, s in engine.offload.shards.items()}
    assert len(paths) >= 3 and all(len(s.tiles) == 1 for s in engine.offload.shards.values())
    trace = []
    real_read, real_adam = store.read, shard_mod._adam

    def read(rec, path, offset, step):
        trace.append(("issue", paths[path], offset))
        real_read(rec, path, offset, step)

    def adam(*a, **kw):
        real_adam(*a, **kw)
        trace.append(("adam_done", None, None))

    monkeypatch.setattr(store, "read", read)
    monkeypatch.setattr(shard_mod, "_adam", adam)
    train(engine, 1, seed=1)
    for _s in engine.offload.shards.values():
        _s.ready.wait()
    events = [e for e in trace if e[0] in ("issue", "adam_done")]
    reads = [gi for op, gi, _ in events if op == "issue"]
    assert sorted(reads) == sorted(paths.values()), events  # each group's tile read once
    done = [i for i, e in enumerate(events) if e[0] == "adam_done"]
    assert len(done) == len(paths)
    for k, i in enumerate(done[:-1]):  # before group k's Adam completed, group k+1's read was issued
        assert sum(e[0] == "issue" for e in events[:i]) == k + 2, events
    assert all(s.commit == 2 for s in engine.offload.shards.values())
