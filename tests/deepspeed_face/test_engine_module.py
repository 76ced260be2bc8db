"""The engine is a torch.nn.Module wrapping the model as ``module`` (DeepSpeed's engine subclasses
Module): parameters, names, state dicts, hooks, train/eval, attribute pass-through, moves refused,
load_state_dict writing into the training state; a destroyed engine still names destroy()."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from dist_helpers import spawn_cases
from zerocore.runtime.release import EngineDestroyed


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 12)
        self.norm = nn.BatchNorm1d(12)  # a buffer beside the parameters
        self.out = nn.Linear(12, 3)
        self.factor = 2.0  # a plain attribute of the model (not "scale": DeepSpeed's engine has scale(loss))

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _cfg(stage=1, **extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}, **extra}


def _train(engine, steps=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=g).to(engine.dtype), torch.randn(4, 3, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_registries_are_the_wrapped_models(stage):
    model = Net()
    engine = zerocore.initialize(model, _cfg(stage))
    assert isinstance(engine, nn.Module)
    assert engine.module is model and dict(engine.named_children()) == {"module": model}
    assert [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in engine.named_parameters()] == ["module." + n for n, _ in model.named_parameters()]
    assert [n for n, _ in engine.named_buffers()] == ["module." + n for n, _ in model.named_buffers()]
    _train(engine)
    sd = engine.state_dict()
    assert list(sd) == ["module." + k for k in model.state_dict()]
    if stage < 3:  # stage 3 parameters rest as empty chunks between uses (as DeepSpeed's do)
        for k, v in model.state_dict().items():
            assert torch.equal(sd["module." + k], v)


def test_train_eval_hooks_and_call_go_through_nn_module():
    model = Net()
    engine = zerocore.initialize(model, _cfg(1))
    assert engine.eval() is engine and not engine.training and not model.training and not model.norm.training
    assert engine.train() is engine and engine.training and model.norm.training
    seen = []
    pre = engine.register_forward_pre_hook(lambda m, args: seen.append(("pre", m is engine, args[0].shape)))
    post = engine.register_forward_hook(lambda m, args, out: seen.append(("post", out.shape)))
    x = torch.randn(4, 6)
    out = engine(x)
    assert seen == [("pre", True, (4, 6)), ("post", (4, 3))]
    torch.testing.assert_close(out, model(x))
    pre.remove()
    post.remove()
    engine(x)
    assert len(seen) == 2  # removed hooks no longer run


def test_model_attributes_show_through_the_engine():
    model = Net()
    engine = zerocore.initialize(model, _cfg(1))
    assert engine.inp is model.inp and engine.factor == 2.0  # DeepSpeed's engine passes these through
    assert engine.optimizer is not None and engine.config is not None  # the engine's own come first
    with pytest.raises(AttributeError, match="'Engine' object has no attribute 'no_such_thing'"):
        engine.no_such_thing
    model._private = 1
    with pytest.raises(AttributeError):  # private names of the model stay the model's
        engine._private


def test_moves_and_conversions_are_refused_unless_they_change_nothing():
    engine = zerocore.initialize(Net(), _cfg(2))
    assert engine.to("cpu") is engine and engine.float() is engine and engine.cpu() is engine
    with pytest.raises(ValueError, match=r"parameter 'inp.weight' \(torch.float32 on cpu -> torch.float16"):
        engine.half()
    with pytest.raises(ValueError, match="convert parameter 'inp.weight'"):
        engine.to(torch.bfloat16)
    _train(engine)  # still trains: nothing was changed by the refused calls


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_load_state_dict_writes_the_training_state(stage, dtype):
    """Loaded values are the parameters and the fp32 master: the next steps start from them, as a
    fresh engine built over a model holding those values does (loaded before any step, so that the
    two have the same, empty, Adam moments)."""
    _check_load(stage, dtype)


def _check_load(stage: int, dtype: str) -> dict:
    extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    engine = zerocore.initialize(Net(0), _cfg(stage, **extra))
    donor = Net(7)
    with torch.no_grad():
        donor.norm.running_mean.uniform_()
    want = {"module." + k: v.clone() for k, v in donor.state_dict().items()}
    result = engine.load_state_dict(want)
    assert result.missing_keys == [] and result.unexpected_keys == []
    got = engine.full_state_dict()
    for k, v in donor.named_parameters():  # the fp32 master holds the loaded fp32 values exactly
        assert torch.equal(got[k], v.float()), k
    for k, v in donor.named_buffers():  # (bf16: buffers are kept in the training dtype)
        torch.testing.assert_close(got[k], v.to(got[k].dtype), rtol=1e-2, atol=0)
    fresh = zerocore.initialize(Net(7), _cfg(stage, **extra))
    with torch.no_grad():
        fresh.module.norm.running_mean.copy_(donor.norm.running_mean)
    _train(engine, steps=2, seed=11)
    _train(fresh, steps=2, seed=11)
    a, b = engine.full_state_dict(), fresh.full_state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    return a


def test_load_state_dict_names_what_does_not_fit():
    engine = zerocore.initialize(Net(), _cfg(2))
    sd = engine.state_dict()
    with pytest.raises(RuntimeError, match=r"missing keys \['module.out.bias'\]"):
        engine.load_state_dict({k: v for k, v in sd.items() if k != "module.out.bias"})
    with pytest.raises(RuntimeError, match=r"unexpected keys \['inp.weight'\]"):
        engine.load_state_dict({**sd, "inp.weight": sd["module.inp.weight"]})
    with pytest.raises(RuntimeError, match=r"'module.out.weight' is \(2, 12\), the model's is \(3, 12\)"):
        engine.load_state_dict({**sd, "module.out.weight": torch.zeros(2, 12)})
    result = engine.load_state_dict({k: v for k, v in sd.items() if k != "module.out.bias"}, strict=False)
    assert result.missing_keys == ["module.out.bias"]
    with pytest.raises(ValueError, match="assign=True"):
        engine.load_state_dict(sd, assign=True)


def _load_run(case, rank, world):
    return {"state": _check_load(*case)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_state_dict_over_two_ranks(stage, tmp_path):
    """Each rank writes its own part of the master (no collective): the ranks agree afterwards."""
    results = spawn_cases([(stage, "bf16")], 2, tmp_path, run=_load_run)
    for rank in range(2):
        assert "error" not in results[rank][0], results[rank][0].get("error")
    a, b = results[0][0]["state"], results[1][0]["state"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_destroyed_engine_still_names_destroy():
    engine = zerocore.initialize(Net(), _cfg(1))
    engine.destroy()
    assert repr(engine) == "Engine(destroyed)" and "destroy" in dir(engine)
    for use in (lambda: list(engine.parameters()), lambda: engine.state_dict(), lambda: engine.train(),
                lambda: engine(torch.randn(4, 6)), lambda: engine.inp):
        with pytest.raises(EngineDestroyed, match=r"destroy\(\)"):
            use()
