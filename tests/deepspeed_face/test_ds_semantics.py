"""Where engines of ``zerocore.deepspeed.initialize`` follow DeepSpeed and ``zerocore.initialize``'s
keep zerocore's own behaviour (zerocore/deepspeed/semantics.py; DeepSpeed's unit tests
TestZeroUnbalancedGradients, TestNoOptim, TestZeroOffloadOptim, TestStage2IgnoreUnusedParameters,
TestZeROElasticCheckpoint::test_elastic_checkpoint_change_dp check the same on DeepSpeed)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.config import ConfigError
from zerocore.deepspeed.runtime.zero.utils import ZeRORuntimeException

from checkpoint_helpers import result, spawn


class Net(torch.nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)
        if unused:
            self.c = torch.nn.Linear(4, 4)  # never in forward

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _cfg(stage=1, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, **zero}}


def _train(engine, steps=2):
    for i in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()


def test_the_face_marks_its_engines():
    engine, *_ = deepspeed.initialize(model=Net(), config=_cfg())
    assert engine.deepspeed_semantics is not None
    assert zerocore.initialize(Net(), _cfg()).deepspeed_semantics is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_requires_grad_turned_off_trains_with_a_zero_gradient(stage):
    engine, *_ = deepspeed.initialize(model=Net(), config=_cfg(stage))
    with zerocore.gathered(list(engine.module.parameters())):
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.module.a.weight.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(engine, 3)
    named = [w for w in caught if "a.weight" in str(w.message) and "zero gradient" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]  # once, naming it
    with zerocore.gathered(list(engine.module.parameters())):
        after = dict(engine.module.named_parameters())
        # a zero gradient from the first step: Adam's moments stay zero, so the update is zero
        assert torch.equal(after["a.weight"], before["a.weight"])
        assert not torch.equal(after["a.bias"], before["a.bias"])
    engine.module.a.weight.requires_grad_(True)
    _train(engine, 1)


def test_zerocore_initialize_still_refuses_requires_grad_turned_off():
    engine = zerocore.initialize(Net(), _cfg())
    engine.module.a.weight.requires_grad_(False)
    x = torch.randn(2, 4)
    engine.backward(engine(x).sum())
    with pytest.raises(RuntimeError, match="'a.weight' was trainable"):
        engine.step()


def test_offload_param_below_stage_3_is_ignored_with_a_warning():
    cfg = _cfg(1, offload_param={"device": "cpu"})
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param ignored"):
        engine, *_ = deepspeed.initialize(model=Net(), config=cfg)
    assert engine.zero_offload_param() is False
    _train(engine)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=False):  # reads the same config, quietly
        Net()
    with pytest.raises(ConfigError, match="offload_param"):
        zerocore.initialize(Net(), cfg)


def test_force_ds_cpu_optimizer_refuses_a_client_optimizer_with_offload():
    cfg = _cfg(1, offload_optimizer={"device": "cpu"})
    del cfg["optimizer"]
    m = Net()
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        deepspeed.initialize(model=m, optimizer=torch.optim.Adam(m.parameters()), config=cfg)
    m = Net()
    engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.Adam(m.parameters()),
                                      config={**cfg, "zero_force_ds_cpu_optimizer": False})
    _train(engine)
    m = Net()
    deepspeed.initialize(model=m, optimizer=deepspeed.ops.adam.DeepSpeedCPUAdam(m.parameters()), config=cfg)
    m = Net()
    zerocore.initialize(m, cfg, optimizer=torch.optim.Adam(m.parameters()))  # zerocore's own: accepted


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_untested_optimizer_is_refused_at_zero_stages_unless_allowed(stage):
    """DeepSpeed's zero_allow_untested_optimizer (default false): at stages 1-3 a client optimizer of a type it
    has not tested (SGD; an Adam subclass too: the exact type counts) is an AssertionError naming the key."""
    cfg = _cfg(stage)
    del cfg["optimizer"]

    class MyAdam(torch.optim.Adam):
        pass

    for opt in (torch.optim.SGD, MyAdam):
        m = Net()
        if stage == 0:
            engine, *_ = deepspeed.initialize(model=m, optimizer=opt(m.parameters(), lr=0.1), config=cfg)
            _train(engine)
            continue
        with pytest.raises(AssertionError, match="zero_allow_untested_optimizer"):
            deepspeed.initialize(model=m, optimizer=opt(m.parameters(), lr=0.1), config=cfg)
    m = Net()
    engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                      config={**cfg, "zero_allow_untested_optimizer": True})
    _train(engine)
    for opt in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, deepspeed.ops.adam.FusedAdam):
        m = Net()
        deepspeed.initialize(model=m, optimizer=opt(m.parameters(), lr=0.1), config=cfg)  # tested: accepted
    m = Net()
    zerocore.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))  # zerocore's own: accepted


def test_ignore_unused_parameters_false_asserts_with_optimizer_offload_at_stages_1_2():
    cfg = _cfg(2, offload_optimizer={"device": "cpu"}, ignore_unused_parameters=False)
    engine, *_ = deepspeed.initialize(model=Net(unused=True), config=cfg)
    x = torch.randn(2, 4)
    engine.backward(engine(x).sum())
    with pytest.raises(AssertionError, match="ignore_unused_parameters") as e:
        engine.step()
    assert "'c.weight'" in str(e.value)
    del e  # its traceback's frames hold the engine: the collector alone would free it (and its pools)
    engine.destroy()
    engine, *_ = deepspeed.initialize(model=Net(), config=cfg)  # every parameter used: trains
    _train(engine)
    for stage in (1, 3):  # without offload (or at stage 3): accepted and without effect, as DeepSpeed
        engine, *_ = deepspeed.initialize(model=Net(unused=True), config=_cfg(stage, ignore_unused_parameters=False))
        _train(engine)
    with pytest.raises(ConfigError, match="ignore_unused_parameters"):
        zerocore.initialize(Net(unused=True), cfg)


def test_face_engines_are_freed_by_reference_counting():
    """The face's checks hold their engine weakly: dropped, an engine is freed without the collector, and
    the hooks its unused-parameter check put on the model go with it."""
    import gc
    import weakref

    cfg = _cfg(2, offload_optimizer={"device": "cpu"}, ignore_unused_parameters=False)
    model = Net()
    gc.disable()
    try:
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        _train(engine)
        ref = weakref.ref(engine)
        del engine, _
        assert ref() is None
        assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    finally:
        gc.enable()


def save_two_ranks(root, rank, world):
    engine, *_ = deepspeed.initialize(model=Net(), config=_cfg(2))
    _train(engine)
    engine.save_checkpoint(root)
    return {"saved": True}


@pytest.mark.slow
def test_optimizer_state_of_another_world_size_is_refused_unless_universal(tmp_path):
    root = str(tmp_path / "ck")
    result(spawn([("save", save_two_ranks, (root,))], 2, tmp_path, timeout=120), "save")
    engine, *_ = deepspeed.initialize(model=Net(), config=_cfg(2))
    with pytest.raises(ZeRORuntimeException, match="DP world size of 2 but the current world size is 1"):
        engine.load_checkpoint(root)
    path, _ = engine.load_checkpoint(root, load_optimizer_states=False)
    assert path is not None
    engine.load_checkpoint(root, load_module_only=True)
    engine, *_ = deepspeed.initialize(model=Net(), config={**_cfg(2), "checkpoint": {"load_universal": True}})
    engine.load_checkpoint(root, tag=open(os.path.join(root, "latest")).read())  # (no tag: latest_universal's)
    _train(engine, 1)
    zerocore.initialize(Net(), _cfg(2)).load_checkpoint(root)  # zerocore's own: resharded
    assert os.path.isfile(os.path.join(root, "latest"))


def save_tagged(root, rank, world):
    engine, *_ = deepspeed.initialize(model=Net(), config=_cfg(2))
    _train(engine)
    engine.save_checkpoint(root, tag="step2")
    return {"weights": engine.full_state_dict(), "steps": engine.global_steps}


@pytest.mark.slow
def test_ds_to_universal_then_load_universal_at_another_world_size(tmp_path):
    """DeepSpeed's route to another world size: save, ``ds_to_universal``, load with ``load_universal`` (the tag
    from ``latest_universal``). Saved on 2 ranks, loaded on 1."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from zerocore.checkpoint.layout import CheckpointError
    from zerocore.deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

    root = tmp_path / "ck"
    saved = result(spawn([("save", save_tagged, (str(root),))], 2, tmp_path, timeout=120), "save")[0]
    args = SimpleNamespace(input_folder=str(root / "step2"), output_folder=str(root / "step2_universal"),
                           num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                           inject_missing_state=False)
    convert_to_universal(args)
    assert sorted(os.listdir(root / "step2_universal")) == sorted(os.listdir(root / "step2"))
    with pytest.raises(CheckpointError, match="exists already"):
        convert_to_universal(args)
    with pytest.raises(CheckpointError, match="not a zerocore checkpoint tag folder"):  # the save dir, not the tag's
        convert_to_universal(SimpleNamespace(input_folder=str(root), output_folder=str(tmp_path / "u")))
    cfg = {**_cfg(2), "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=Net(), config=cfg)
    with pytest.raises(ValueError, match="latest_universal does not exist"):
        engine.load_checkpoint(str(root))
    (root / "latest_universal").write_text("step2_universal")
    path, _ = engine.load_checkpoint(str(root))
    assert path.endswith("step2_universal") and engine.global_steps == saved["steps"]
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], w) for k, w in saved["weights"].items())
    _train(engine, 1)
    # the command line, on a folder with a file cut short: refused, naming the file, nothing left behind
    victim = next(f for f in sorted(os.listdir(root / "step2")) if f.endswith(".bin") or "rank" in f)
    with open(root / "step2" / victim, "r+b") as f:
        f.truncate(1)
    proc = subprocess.run([sys.executable, "-m", "zerocore.deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(root / "step2"), "--output_folder", str(root / "again")], capture_output=True, text=True)
    assert proc.returncode != 0 and victim in proc.stderr and "the manifest records" in proc.stderr
    assert not (root / "again").exists() and not any(n.startswith(".tmp-") for n in os.listdir(root))


@pytest.mark.parametrize("stage, dtype, check, skips", [
    (0, "fp32", True, False), (0, "bf16", True, True), (0, "bf16", False, False), (0, "fp16", True, True),
    (1, "fp32", True, True), (2, "fp32", True, True), (2, "bf16", True, True), (2, "bf16", False, False),
    (3, "fp32", True, True), (3, "bf16", False, True), (3, "fp16", True, True)])
def test_a_nonfinite_gradient_skips_where_deepspeed_skips(stage, dtype, check, skips):
    """DeepSpeed 0.19.8's rule (compared side by side in test_against_deepspeed.py): the face's engines skip
    the boundary; zerocore.initialize's skip only with fp16 or bf16.check_grad_overflow."""
    from zerocore.deepspeed.semantics import skips_nonfinite

    cfg = _cfg(stage)
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True, **({"check_grad_overflow": check} if dtype == "bf16" else {})}
    for face in (True, False):
        engine = deepspeed.initialize(model=Net(), config=cfg)[0] if face else zerocore.initialize(Net(), cfg)
        assert skips_nonfinite(engine.config) == skips
        x = torch.randn(2, 4).to(torch.bfloat16 if dtype == "bf16" else torch.float16 if dtype == "fp16" else
                                 torch.float32)
        hook = engine.module.b.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        engine.backward(engine(x).float().square().mean())
        hook.remove()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.step()
            zc_skips = dtype == "fp16" or (dtype == "bf16" and check)
            assert engine.skipped_steps == int(skips if face else zc_skips), (face, engine.skipped_steps)
        engine.destroy()
