"""An engine that trains nothing (``zerocore.initialize(frozen=True)``, runtime/trains_nothing.py): a reference,
teacher or evaluation model. On 2 spawned gloo ranks at stage 3 (fp32 and bf16): each rank holds 1/2 of the
weights in the training dtype and nothing else (no gradient, master or moments: the tensors held and the bytes of
every tensor alive in the process), the forward equals the plain model's bit for bit, gradients reach the inputs
through it, ``backward``/``step`` and a backward into parameters that require grad are refused; one rank at
stages 0-3; the refusals at initialize."""
from __future__ import annotations

import copy

import pytest
import torch

import zerocore
from dist_helpers import gc_tensor_bytes
from stage3_ranks import results, spawn, stack
from zerocore.runtime.trains_nothing import NothingToTrain

D = 64


def _config(stage: int = 3, dtype: str = "fp32") -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_unit_min_params": 100}}


def _refusals(engine, x) -> dict:
    out = {}
    for what, call in (("backward", lambda: engine.backward(engine(x).float().sum())),
                       ("step", engine.step),
                       ("loss_backward", lambda: engine(x).float().sum().backward())):
        try:
            call()
            out[what] = None
        except NothingToTrain as e:
            out[what] = (isinstance(e, AssertionError), str(e))
    return out


def _frozen_on_ranks(dtype: str, rank: int, world: int) -> dict:
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = stack(n=4, d=D)
    plain = copy.deepcopy(model).to(low)
    plain_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    engine = zerocore.initialize(model, _config(3, dtype), frozen=True)
    report = engine.memory_report()
    alive = gc_tensor_bytes()  # the plain copy, the engine's chunk, and what else lives
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(rank)).to(low)
    with torch.no_grad():
        y, want = engine(x), plain(x)
    out = {"report": report, "alive_beyond_plain": alive - plain_bytes, "whole": plain_bytes,
           "forward_equal": torch.equal(y, want), "param_elems": sum(p.numel() for p in model.parameters()),
           "state_equal": all(torch.equal(v, plain.state_dict()[k]) for k, v in engine.full_state_dict().items()),
           "refusals": _refusals(engine, x), "face_groups": [len(g["params"]) for g in engine.optimizer.param_groups]}
    engine.destroy()
    # frozen by requires_grad: a backward through it brings the inputs their gradients, as through the plain model
    model = stack(n=4, d=D).requires_grad_(False)
    plain = copy.deepcopy(model).to(low)
    engine = zerocore.initialize(model, _config(3, dtype), frozen=True)
    grads = []
    for step in range(2):  # twice: a backward that reached it leaves nothing open
        xs = [x.detach().clone().requires_grad_(True) for _ in range(2)]
        engine(xs[0]).float().square().sum().backward()
        plain(xs[1]).float().square().sum().backward()
        grads.append(torch.equal(xs[0].grad, xs[1].grad))
    out["input_grads_equal"] = grads
    engine.destroy()
    return out


def sc_handover_bf16(rank: int, world: int) -> dict:
    """An evaluation engine, then a training engine over the same model, which stays partitioned in between
    (``destroy(partitioned=True)``), beside a training engine over the plain model in the training dtype."""
    low = torch.bfloat16
    model = stack(n=4, d=D)
    plain = copy.deepcopy(model).to(low)
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    engine = zerocore.initialize(model, _config(3, "bf16"), frozen=True)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(rank)).to(low)
    with torch.no_grad():
        engine(x)
    before = gc_tensor_bytes()
    engine.destroy(partitioned=True)
    out = {"alive_change": gc_tensor_bytes() - before, "whole": whole,
           "empty": all(p.numel() == 0 for p in model.parameters()),
           "chunks": [p._zc_init.chunk.numel() for p in model.parameters()],
           "numels": [p.numel() for p in plain.parameters()]}
    train_cfg = {**_config(3, "bf16"), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engines = [zerocore.initialize(model, train_cfg), zerocore.initialize(plain, train_cfg)]
    for step in range(2):
        for e in engines:
            e.backward(e(x).float().square().sum())
            e.step()
    got, want = (e.full_state_dict() for e in engines)
    out["trained_equal"] = all(torch.equal(got[k], want[k]) for k in want)
    for e in engines:
        e.destroy()
    return out


def sc_frozen_fp32(rank: int, world: int) -> dict:
    return _frozen_on_ranks("fp32", rank, world)


def sc_frozen_bf16(rank: int, world: int) -> dict:
    return _frozen_on_ranks("bf16", rank, world)


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory):
    return spawn([sc_frozen_fp32, sc_frozen_bf16, sc_handover_bf16], 2, tmp_path_factory.mktemp("frozen"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage3_frozen_engine_holds_its_partition_only_and_runs_the_model(on_two_ranks, dtype):
    for r in results(on_two_ranks, f"frozen_{dtype}"):
        rep = r["report"]
        # the ZeRO formula: this rank's chunk of the weights in the training dtype, nothing else
        assert r["whole"] / 2 <= rep["frozen"] <= r["whole"] / 2 + 4 * 64, rep
        assert rep["total"] == rep["frozen"] and rep["host_total"] == 0
        # what the process holds: no more than that chunk beside the plain copy (a few small tensors of slack)
        assert r["alive_beyond_plain"] <= rep["frozen"] + 16 * 1024, r["alive_beyond_plain"]
        assert r["param_elems"] == 0  # every parameter released outside the forward
        assert r["forward_equal"] and r["state_equal"]
        assert r["face_groups"] == [0]
        for what, refused in r["refusals"].items():
            assert refused is not None and refused[0], what  # an AssertionError too, as DeepSpeed's
            assert "trains nothing" in refused[1] and "torch.no_grad()" in refused[1]
        assert r["input_grads_equal"] == [True, True]


def test_stage3_evaluation_engine_hands_its_partitioned_model_to_a_training_engine(on_two_ranks):
    for r in results(on_two_ranks, "handover_bf16"):
        # each parameter its rank's chunk (ceil(numel / 2) elements), the whole model never held
        assert r["empty"] and r["chunks"] == [-(-n // 2) for n in r["numels"]]
        # the engine's chunk became the parameters' chunks: the bytes alive did not grow by half the model, as a
        # whole hand-over (destroy()) makes them (+16.5 KB of 33 KB here). Measured -120 B; now and then, when other
        # tests ran in the parent first, +8.2 KB: one unit's whole buffer (8.3 KB) still alive a moment after the
        # gather that cut its chunks (likely held by gloo's work object until it is released; not chased further)
        assert r["alive_change"] <= 3 * r["whole"] / 8, r["alive_change"]
        # trained from the evaluation engine's values (the model in the training dtype), bit for bit
        assert r["trained_equal"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_frozen_engine_at_every_stage(stage):
    torch.manual_seed(0)
    model = stack(n=3, d=16)
    plain = copy.deepcopy(model)
    engine = zerocore.initialize(model, _config(stage), frozen=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(engine(x), plain(x))
    rep = engine.memory_report()
    assert rep["grads"] == rep["master"] == rep["exp_avg"] == rep["exp_avg_sq"] == rep["params"] == 0
    with pytest.raises(NothingToTrain, match=r"step\(\) on an engine that trains nothing"):
        engine.step()
    with pytest.raises(AssertionError, match=r"backward\(\) on an engine that trains nothing"):
        engine.backward(engine(x).sum())
    engine.destroy()


def test_initialize_refusals_name_the_problem():
    with pytest.raises(ValueError, match="no trainable parameters .*pass frozen=True"):
        zerocore.initialize(stack(n=2, d=8).requires_grad_(False), _config(1))
    model = stack(n=2, d=8)
    with pytest.raises(ValueError, match="frozen=True trains nothing; optimizer, lr_scheduler would be ignored"):
        zerocore.initialize(model, _config(3), frozen=True, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            lr_scheduler=lambda opt: None)
    with pytest.raises(ValueError, match="the model has no parameters"):
        zerocore.initialize(torch.nn.Tanh(), _config(3), frozen=True)


def test_deepspeed_face_without_an_optimizer_is_deepspeeds_inference_engine():
    """``deepspeed.initialize`` with no optimizer and no 'optimizer' section: stages 1 and 2 refuse as DeepSpeed
    asserts; stages 0 and 3 build an engine that trains nothing (DeepSpeed's ``DeepSpeedZeRoOffload`` at stage 3) and
    return no optimizer; model_parameters are ignored there, said in a warning."""
    import zerocore.deepspeed as deepspeed

    for stage in (1, 2):
        with pytest.raises(AssertionError, match=f"zero stage {stage} requires an optimizer"):
            deepspeed.initialize(model=stack(n=2, d=8), config=_config(stage))
    for stage in (0, 3):
        model = stack(n=2, d=8)
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=_config(stage))
        assert not engine.trains and optimizer is None and scheduler is None
        engine.destroy()
    model = stack(n=2, d=8)
    with pytest.warns(UserWarning, match="trains nothing .*model_parameters is ignored"):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
    engine.destroy()
    # with an 'optimizer' section (or an optimizer passed) it trains
    engine, optimizer, _, _ = deepspeed.initialize(
        model=stack(n=2, d=8), config={**_config(3), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert engine.trains and optimizer is engine.optimizer
    engine.destroy()


def test_frozen_engine_over_a_model_built_under_zerocore_init():
    """A model partitioned as it was built (``zerocore.init``, how a model larger than one rank is loaded) runs on an
    engine that trains nothing: its values are the ones built, nothing is made whole outside the forward."""
    cfg = _config(3)
    torch.manual_seed(0)
    plain = stack(n=3, d=16)
    torch.manual_seed(0)
    with zerocore.init(cfg):
        model = stack(n=3, d=16)
    engine = zerocore.initialize(model, cfg, frozen=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(engine(x), plain(x))
    assert all(p.numel() == 0 for p in model.parameters())
    assert engine.memory_report()["master"] == 0
    engine.destroy()
