"""Sharded checkpoints: saved at world 4 stage 3 (fp32, bf16, fp16 with a dynamic loss scale;
accumulation, clipping, an lr drop) after 3 steps, resumed at world 4 stage 3 (bit-exact), at
world 2 with stages 1, 2 and 3 and at world 1 with stage 0, then 3 more steps against the
uninterrupted 6-step run. A rank killed in the middle of a save, corrupt / truncated / missing
files, another model, the offline consolidation to safetensors.

Tolerances: the same world and stage resumes bit-exactly (every dtype). Another world size
sums gradients in another order: fp32 uses the stage tests' tolerances (``assert_fp32_close``);
16-bit runs are compared by each tensor's training delta, within 2% (bf16) / 0.5% (fp16), an
order of magnitude below the stage tests' dtype bounds, since both runs train in the same dtype.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from checkpoint_helpers import CkCase, async_run, kill_run, new_engine, result, resume_run, save_run, spawn, train
from dist_helpers import make_model, relative_delta_error
from test_stages import _mask, assert_fp32_close

CASES = {c.name: c for c in [
    CkCase("fp32"),
    CkCase("bf16", dtype="bf16", lr=3e-3),
    # the scale grows every 2 clean steps and halves at the overflow injected at step 4 (after the resume)
    CkCase("fp16", dtype="fp16", lr=3e-3, inject_inf=(4, 0),
           fp16={"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}),
]}
W2_LOADS = [("fp32", 1), ("fp32", 2), ("fp32", 3), ("bf16", 2), ("fp16", 3)]
DELTA_TOL = {"bf16": 0.02, "fp16": 0.005}  # measured: 0.008 / 0.0009 at most


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """World 4: every case saved at step 3 and run to step 6."""
    root = tmp_path_factory.mktemp("ckpts")
    jobs = [(name, save_run, (c, str(root))) for name, c in CASES.items()]
    # the work is ~15 s; starting 4 ranks is the rest (40 s at a load average of 15)
    per_rank = spawn(jobs, 4, tmp_path_factory.mktemp("w4"), timeout=90)
    return root, per_rank


@pytest.fixture(scope="module")
def resumed_w2(saved, tmp_path_factory):
    root, per_rank = saved
    for name in CASES:
        result(per_rank, name)  # the save itself worked
    jobs = [(f"{name}_stage{stage}", resume_run, (CASES[name], str(root), stage)) for name, stage in W2_LOADS]
    jobs.append(("async", async_run, (str(root / "async"),)))
    os.makedirs(root / "kill")
    jobs.append(("kill", kill_run, (str(root / "kill"),)))  # last: it kills rank 1
    return spawn(jobs, 2, tmp_path_factory.mktemp("w2"), timeout=60)


def _compare(case: CkCase, got: dict, want: dict, init: dict) -> None:
    for k, w in want.items():
        g = got[k]
        if case.dtype == "fp32":
            assert_fp32_close(k, g, w, init[k])
        else:
            keep = _mask(k, w)  # the attention key bias: no true gradient, pure rounding noise
            rd = relative_delta_error(g[keep], w[keep], init[k][keep].float())
            assert rd <= DELTA_TOL[case.dtype], f"{k}: relative delta error {rd:.3g} > {DELTA_TOL[case.dtype]}"


def _check_resume(case: CkCase, saved_run: dict, res: dict, exact: bool) -> None:
    assert res["client"] == {"case": case.name, "step": 3}
    # counters, lr (halved after step 2) and the loss scale as they were at the save
    assert res["loaded"][:4] == (6, 3, 3, 0) and res["loaded"][4] == saved_run["first"]["lrs"][-1]
    assert res["loaded"][5] == saved_run["first"]["scales"][-1]
    # the schedule and the loss scaler continue exactly: same scales, skips and lrs every step
    for key in ("scales", "skipped", "lrs"):
        assert res["rest"][key] == saved_run["rest"][key], key
    assert res["counters"] == saved_run["counters"]
    if exact:
        assert res["rest"]["losses"] == saved_run["rest"]["losses"]
        for k, w in saved_run["at6"].items():
            assert torch.equal(res["at6"][k], w), f"{k} differs after a resume at the same world and stage"
    else:
        _compare(case, res["at6"], saved_run["at6"], saved_run["at3"])


@pytest.mark.parametrize("name", list(CASES))
def test_resume_same_world_and_stage_is_exact(saved, name):
    _, per_rank = saved
    runs = result(per_rank, name)
    for r in runs:  # each rank against its own uninterrupted run (the losses are per rank)
        _check_resume(CASES[name], r, r["same_world"], exact=True)
    if name == "fp16":  # the overflow happened after the resume and was skipped there too
        assert runs[0]["rest"]["skipped"] == [0, 1, 1]


@pytest.mark.parametrize("name,stage", W2_LOADS, ids=[f"{n}_stage{s}" for n, s in W2_LOADS])
def test_resume_at_world2(saved, resumed_w2, name, stage):
    _, per_rank = saved
    want = result(per_rank, name)[0]
    for r in result(resumed_w2, f"{name}_stage{stage}"):
        _check_resume(CASES[name], want, r, exact=False)


def test_async_save_holds_the_state_of_the_call(saved, resumed_w2):
    root, _ = saved
    for r in result(resumed_w2, "async"):
        assert r["path"] == str(root / "async" / "global_step2") and r["client"] == {"a": 1}
        assert r["equal"] == r["keys"]  # trained on while writing, loaded back the state of the call
        assert r["steps_after"] == (4, 4)  # the second async save finished before the load that followed
    assert (root / "async" / "latest").read_text() == "second"


def test_resume_at_world1_stage0(saved):
    root, per_rank = saved
    case = CASES["fp32"]
    want = result(per_rank, "fp32")[0]
    e = new_engine(case, 0, seed=1)
    path, client = e.load_checkpoint(str(root / "fp32"))
    res = {"client": client, "loaded": (e.micro_steps, e.global_steps, e.optimizer_steps, e.skipped_steps, e.lr,
                                        e.loss_scale)}
    assert e.full_state_dict().keys() == want["at3"].keys()
    for k, w in want["at3"].items():  # loading alone gives back the saved weights exactly
        assert torch.equal(e.full_state_dict()[k], w), k
    res["rest"] = train(e, case, 0, 1, 3, 6)
    res["at6"] = e.full_state_dict()
    res["counters"] = (e.micro_steps, e.global_steps, e.optimizer_steps, e.skipped_steps)
    _check_resume(case, want, res, exact=False)


# -- a rank killed in the middle of a save ----------------------------------------------------------
def test_kill9_mid_save_leaves_previous_tag(saved, resumed_w2):
    root, _ = saved
    kill_dir = root / "kill"
    assert "kill" not in resumed_w2[1]  # the victim died before reporting
    # the other rank did not hang: it failed cleanly when its peer vanished
    assert "error" in resumed_w2[0]["kill"], resumed_w2[0].get("kill")
    assert (kill_dir / "latest").read_text() == "good"
    entries = sorted(os.listdir(kill_dir))
    assert entries == [".tmp-global_step2", "good", "latest", "zero_to_fp32.py"], entries  # the half save: a temp dir
    case = CkCase("kill", model="mlp", stage=2)
    e = new_engine(case, 1, seed=3)
    with pytest.raises(Exception, match="global_step2"):
        e.load_checkpoint(str(kill_dir), tag="global_step2")
    path, _ = e.load_checkpoint(str(kill_dir))
    assert path == str(kill_dir / "good") and e.global_steps == 1
    train(e, case, 0, 1, 1, 2)  # trains on
    with pytest.warns(RuntimeWarning, match="interrupted save"):
        e.save_checkpoint(str(kill_dir))  # removes the debris, publishes the new tag
    assert sorted(os.listdir(kill_dir)) == ["global_step2", "good", "latest", "zero_to_fp32.py"]


# -- damaged checkpoints, other models, missing ones --------------------------------------------------
def _damaged(root, tmp_path, how: str):
    src = root / "fp32" / "global_step3"
    dst = tmp_path / "ck"
    shutil.copytree(src.parent, dst)
    tag = dst / "global_step3"
    if how == "flip":
        f = tag / "rank00002.bin"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
        return dst, "rank00002.bin"
    if how == "truncate":
        f = tag / "rank00001.bin"
        f.write_bytes(f.read_bytes()[:-100])
        return dst, "rank00001.bin"
    if how == "delete":
        os.remove(tag / "rank00003.bin")
        return dst, "rank00003.bin"
    (tag / "manifest.json").write_text((tag / "manifest.json").read_text()[:-20])
    return dst, "manifest.json"


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "manifest"])
def test_damaged_checkpoint_names_the_file(saved, tmp_path, how):
    root, _ = saved
    ck, name = _damaged(root, tmp_path, how)
    e = new_engine(CASES["fp32"], 0, seed=1)
    with pytest.raises(Exception, match=name):
        e.load_checkpoint(str(ck))


def test_other_model_is_refused_with_differences(saved):
    root, _ = saved
    from zerocore.demo import TinyGPT

    import zerocore

    torch.manual_seed(0)
    other = TinyGPT(vocab=31, dim=32, layers=1, heads=2, ctx=12)  # another vocab, one block fewer
    e = zerocore.initialize(other, CASES["fp32"].config(0, 1))
    with pytest.raises(Exception, match="different model") as info:
        e.load_checkpoint(str(root / "fp32"))
    msg = str(info.value)
    assert "'tok.weight': shape [31, 32] in the model, [29, 32] in the checkpoint" in msg
    assert "checkpoint parameter 'blocks.1." in msg


def test_no_checkpoint_and_missing_tag(tmp_path):
    e = new_engine(CASES["fp32"], 0)
    with pytest.warns(UserWarning, match="no checkpoint"):
        assert e.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.raises(Exception, match="tag 'nope'"):
        e.load_checkpoint(str(tmp_path), tag="nope")
    with pytest.raises(ValueError, match="not allowed"):
        e.save_checkpoint(str(tmp_path), tag=".tmp-x")


def test_load_module_only_with_another_optimizer_config(saved):
    root, per_rank = saved
    want = result(per_rank, "fp32")[0]["at3"]
    case = CkCase("fp32", lr=5e-4, clip=0.0)
    cfg = case.config(2, 1)
    cfg["optimizer"]["params"].update(betas=[0.8, 0.9], weight_decay=0.0)
    import zerocore

    e = zerocore.initialize(make_model("gpt", 7), cfg)
    path, client = e.load_checkpoint(str(root / "fp32"), load_module_only=True)
    assert client == {}
    assert (e.global_steps, e.optimizer_steps, e.lr) == (0, 0, 5e-4)
    got = e.full_state_dict()
    for k, w in want.items():
        assert torch.equal(got[k], w), k
    assert all(not s.exp_avg.any() for s in e.shards)
    train(e, case, 0, 1, 3, 4)


def test_frozen_parameters_and_buffers_round_trip(tmp_path):
    import zerocore
    from torch import nn

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(37, 24), nn.BatchNorm1d(24), nn.Linear(24, 24), nn.Linear(24, 11))
        m[2].requires_grad_(False)
        return m

    cfg = CkCase("x", model="mlp").config(0, 1)
    e = zerocore.initialize(model(), cfg)
    case = CkCase("x", model="mlp")
    train(e, case, 0, 1, 0, 2)
    e.save_checkpoint(str(tmp_path), tag="t")
    e.save_checkpoint(str(tmp_path), tag="t")  # again: swapped in atomically, the old copy removed
    from zerocore.checkpoint import save as ck_save

    ck_save.finish_removals()  # the removal runs in the background once the new copy is published
    assert sorted(os.listdir(tmp_path)) == ["latest", "t", "zero_to_fp32.py"]
    m2 = model()
    m2[2].weight.data.mul_(2)
    e2 = zerocore.initialize(m2, cfg)
    e2.load_checkpoint(str(tmp_path))
    a, b = e.full_state_dict(), e2.full_state_dict()
    assert a.keys() == b.keys() and "1.num_batches_tracked" in a and a["1.num_batches_tracked"].item() == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- offline: consolidation to safetensors, full state dicts, inspect --------------------------------
def test_consolidate_stage3_world4_into_a_plain_model(saved, tmp_path):
    load_file = pytest.importorskip("safetensors.torch").load_file

    from zerocore.checkpoint import consolidate, load_full_state_dict
    from zerocore.cli import main

    root, per_rank = saved
    want = result(per_rank, "fp32")[0]["at3"]  # engine.full_state_dict() at the save
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(root / "fp32"), "--out", str(out)]) == 0
    model = make_model("gpt", 5)
    missing, unexpected = model.load_state_dict(load_file(str(out)), strict=False)
    assert missing == ["head.weight"] and unexpected == []  # the tied alias, stored once as tok.weight
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert torch.equal(got[k], w), k
    full = load_full_state_dict(str(root / "fp32"))
    assert full.keys() == want.keys() and all(torch.equal(full[k], w) for k, w in want.items())
    # a tied weight is one tensor under both names (torch.save then stores it once; DeepSpeed's zero_to_fp32 too)
    assert full["head.weight"] is full["tok.weight"]
    # sharded, 16-bit: the index maps every tensor to its file; the values are the fp32 ones rounded
    files = consolidate(str(root / "fp32"), str(tmp_path / "bf" / "model.safetensors"), dtype="bf16",
                        max_shard_size="10KB")
    index = __import__("json").loads((tmp_path / "bf" / "model.safetensors.index.json").read_text())
    assert len(files) > 3 and files[-1].endswith(".index.json")
    shards = {}
    for f in files[:-1]:
        shards.update(load_file(f))
    assert set(index["weight_map"]) == set(shards) == set(want) - {"head.weight"}
    for k, t in shards.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[k].to(torch.bfloat16)), k


def test_inspect(saved, capsys):
    from zerocore.cli import main

    root, _ = saved
    assert main(["inspect", str(root / "fp16"), "--json"]) == 0
    info = __import__("json").loads(capsys.readouterr().out)
    assert (info["world_size"], info["stage"], info["dtype"], info["global_steps"]) == (4, 3, "float16", 3)
    assert info["files"] == 4 and info["trainable_elements"] == 26784 and info["loss_scale"] == 512.0


@pytest.mark.slow  # importing transformers alone takes ~15 s here
def test_consolidate_hugging_face_gpt2(tmp_path):
    transformers = pytest.importorskip("transformers")
    load_file = pytest.importorskip("safetensors.torch").load_file

    import zerocore
    from zerocore.checkpoint import consolidate

    conf = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    cfg = CkCase("hf").config(3, 1)
    cfg["zero_optimization"]["stage3_unit_classes"] = ["GPT2Block"]
    e = zerocore.initialize(transformers.GPT2LMHeadModel(conf), cfg)
    ids = torch.randint(0, 61, (2, 12))
    for _ in range(2):
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()
    e.save_checkpoint(str(tmp_path / "ck"))
    want = e.full_state_dict()
    consolidate(str(tmp_path / "ck"), str(tmp_path / "gpt2.safetensors"))
    fresh = transformers.GPT2LMHeadModel(conf)
    missing, unexpected = fresh.load_state_dict(load_file(str(tmp_path / "gpt2.safetensors")), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    got = fresh.state_dict()
    for k, w in want.items():
        assert torch.equal(got[k], w), k


_PEAK_SCRIPT = r"""
import sys, torch, zerocore, zerocore.checkpoint as ck, safetensors.torch

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

ck.consolidate(sys.argv[1], sys.argv[2] + ".warm", tag="small")  # imports and first-use allocations
base = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
    f.write("5")
ck.consolidate(sys.argv[1], sys.argv[2], tag="big")
print(rss("VmHWM:") - base)
"""


def test_consolidate_peak_memory_is_one_tensor_not_the_model(tmp_path):
    """64 MiB of fp32 weights in 16 tensors of 4 MiB: the consolidating process's resident
    memory grows by less than 2 tensors (the issue's target)."""
    import subprocess
    import sys

    import zerocore
    from torch import nn

    e = zerocore.initialize(nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)]),
                            {"zero_optimization": {"stage": 0}, "gradient_clipping": 0.0})
    e.save_checkpoint(str(tmp_path / "ck"), tag="big")
    e2 = zerocore.initialize(nn.Linear(4, 4), {"zero_optimization": {"stage": 0}})
    e2.save_checkpoint(str(tmp_path / "ck"), tag="small")  # another model's tag in the same directory
    largest = 1024 * 1024 * 4
    r = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "ck"), str(tmp_path / "out.safetensors")],
                       capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(
                           zerocore.__file__)))
    assert r.returncode == 0, r.stderr
    grew = int(r.stdout.split()[-1])
    model_bytes = 16 * largest
    assert os.path.getsize(tmp_path / "out.safetensors") > model_bytes
    print(f"consolidation peak RSS growth {grew / 2**20:.1f} MiB (model 64 MiB, largest tensor 4 MiB)")
    assert grew < 2 * largest, f"consolidation grew RSS by {grew / 2**20:.1f} MiB (model 64 MiB)"


def test_without_optimizer_states_and_mid_accumulation(saved, tmp_path):
    root, per_rank = saved
    want = result(per_rank, "fp32")[0]
    e = new_engine(CASES["fp32"], 1, seed=1)
    e.load_checkpoint(str(root / "fp32"), load_optimizer_states=False)
    # weights, counters and lr as saved; the moments start afresh, and so does Adam's step count
    assert (e.global_steps, e.optimizer_steps, e.lr) == (3, 0, want["first"]["lrs"][-1])
    assert all(not s.exp_avg.any() and not s.exp_avg_sq.any() for s in e.shards)
    got = e.full_state_dict()
    assert all(torch.equal(got[k], w) for k, w in want["at3"].items())
    from dist_helpers import loss_fn, make_batch

    x, y = make_batch("gpt", 0, 8, 0)
    e.backward(loss_fn("gpt", e(x), y))  # gas is 2: the first micro-batch leaves the step half done
    # allowed, as DeepSpeed allows it, and said: the window's gradients are not saved
    with pytest.warns(RuntimeWarning, match="middle of gradient accumulation"):
        e.save_checkpoint(str(tmp_path), tag="between")
    e.step()
    with pytest.warns(RuntimeWarning, match="middle of gradient accumulation"):
        e.save_checkpoint(str(tmp_path), tag="after")
    assert sorted(os.listdir(tmp_path)) == ["after", "between", "latest", "zero_to_fp32.py"]
