"""Misuse gets a named error and leaves nothing silently wrong (issue 15): what one process can
show here, and on spawned gloo ranks below (ranks that disagree are refused at start, every rank
raising the same error, within seconds)."""
from __future__ import annotations

import os
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore.config import load_config
from forked_ranks import start_ranks


def small_model(seed: int = 0, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, out))


def one_step(engine, x=None):
    x = torch.randn(4, 5) if x is None else x
    loss = engine(x.to(engine.dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss


# -- learning rate and counters (items 4) --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), "0.1", None])
def test_lr_setter_rejects_bad_values_and_keeps_the_old_one(bad):
    engine = zerocore.initialize(small_model(), {"optimizer": {"params": {"lr": 0.01}}})
    with pytest.raises((ValueError, TypeError), match="engine.lr must be"):
        engine.lr = bad
    assert engine.lr == 0.01
    engine.lr = torch.tensor(0.5)  # a scheduler's 0-dim tensor
    assert engine.lr == 0.5


@pytest.mark.parametrize("stage", [0, 2])
def test_a_failed_step_changes_no_counter_and_the_next_equals_a_clean_run(stage, monkeypatch):
    cfg = {"zero_optimization": {"stage": stage}, "optimizer": {"params": {"lr": 0.01}}, "gradient_clipping": 0.0}
    clean, broken = small_model(), small_model()
    e_clean, e_broken = zerocore.initialize(clean, cfg), zerocore.initialize(broken, cfg)
    x = torch.randn(4, 5)
    one_step(e_clean, x)
    one_step(e_broken, x)
    # a failure inside the update (here: the multi-tensor Adam call raises once)
    def fail(*a, **k):
        raise RuntimeError("injected failure in the update")

    counters = (e_broken.micro_steps, e_broken.global_steps, e_broken.optimizer_steps, e_broken.skipped_steps)
    e_broken.backward(e_broken(x).pow(2).mean())
    with monkeypatch.context() as m:
        m.setattr(zerocore.ops, "adam_step_multi", fail)
        with pytest.raises(RuntimeError, match="injected failure"):
            e_broken.step()
    assert (e_broken.micro_steps, e_broken.global_steps, e_broken.optimizer_steps,
            e_broken.skipped_steps) == counters
    e_broken.zero_grad()
    x2 = torch.randn(4, 5)
    one_step(e_clean, x2)
    one_step(e_broken, x2)
    assert e_broken.optimizer_steps == e_clean.optimizer_steps == 2
    for (n, a), b in zip(clean.state_dict().items(), broken.state_dict().values()):
        assert torch.equal(a, b), n  # Adam's step count was not advanced by the failed step


# -- engine use (backward argument, zero_grad between backward and step, input dtype) ---------------------
def test_backward_needs_the_loss_tensor():
    engine = zerocore.initialize(small_model(), {})
    with pytest.raises(TypeError, match=r"engine.backward\(loss\) needs the loss tensor .* got float 3.0"):
        engine.backward(3.0)
    with pytest.raises(ValueError, match=r"needs a scalar loss, got a tensor of shape \(4, 3\)"):
        engine.backward(engine(torch.randn(4, 5)))
    with torch.no_grad():
        detached = engine(torch.randn(4, 5)).sum()
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(detached)
    one_step(engine)  # nothing was left half done
    assert engine.optimizer_steps == 1


def test_step_after_zero_grad_between_backward_and_step_says_what_happened():
    engine = zerocore.initialize(small_model(), {"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(4, 5)).pow(2).mean())
    engine.zero_grad()
    with pytest.raises(RuntimeError, match=r"step\(\) without backward\(\).*zero_grad\(\) after the last backward\(\) "
                                           r"discarded its gradients"):
        engine.step()
    assert engine.micro_steps == 0 and engine.optimizer_steps == 0
    one_step(engine)
    assert engine.optimizer_steps == 1


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_wrong_input_dtype_names_both_dtypes(dtype):
    engine = zerocore.initialize(small_model(), {dtype: {"enabled": True}})
    name = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    with pytest.raises(RuntimeError, match=f"the engine holds the model in {name} and input #0 of the forward is "
                                           "float32; cast floating inputs"):
        engine(torch.randn(4, 5))
    one_step(engine)  # the right dtype still trains


# -- what initialize refuses (items 8, 10; meta; config re-validation) -------------------------------------
def test_meta_model_is_refused_naming_a_parameter():
    with torch.device("meta"):
        model = small_model()
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device .*zerocore.init"):
        zerocore.initialize(model, {})


def test_initialize_twice_is_refused_until_destroy():
    model = small_model()
    first = zerocore.initialize(model, {"zero_optimization": {"stage": 2}})
    one_step(first)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' belongs to a live zerocore engine \(Engine at "
                                           r"0x[0-9a-f]+: stage 2, model Sequential, 1 optimizer steps\).*destroy"):
        zerocore.initialize(model, {"zero_optimization": {"stage": 2}})
    trained = {k: v.clone() for k, v in first.full_state_dict().items()}
    first.destroy()
    first.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="this engine was destroyed"):
        first(torch.randn(2, 5))
    for k, v in model.state_dict().items():  # the model holds its trained values, in tensors of its own
        assert torch.equal(v, trained[k]), k
    with zerocore.initialize(model, {"zero_optimization": {"stage": 1}}) as second:
        one_step(second)  # the first engine's hooks are gone: no "gradient outside backward"
        assert second.optimizer_steps == 1
    zerocore.initialize(model, {})  # released by the context manager


def test_stage3_model_handed_to_a_second_engine_keeps_its_values():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}
    with zerocore.initialize(model, cfg) as first:
        one_step(first, torch.randn(4, 64))
        trained = first.full_state_dict()
    assert all(p.numel() > 0 for p in model.parameters())
    assert type(model[0]) is nn.Linear  # stage 3's class swap is undone
    second = zerocore.initialize(model, cfg)
    assert sum(g.layout.numel for g in second.groups) == sum(v.numel() for v in trained.values())
    for k, v in second.full_state_dict().items():
        assert torch.equal(v, trained[k]), k
    one_step(second, torch.randn(4, 64))


def test_mutated_config_is_validated_at_initialize():
    cfg = load_config({"zero_optimization": {"stage": 1}})
    cfg.zero_optimization.stage = "3"
    with pytest.raises(zerocore.ConfigError, match="zero_optimization.stage: got the string '3'"):
        zerocore.initialize(small_model(), cfg)


def test_root_class_in_unit_classes_is_the_root_unit():
    model = small_model()
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3, "stage3_unit_classes": ["Sequential"]}})
    one_step(engine)
    assert engine.optimizer_steps == 1


# -- on 2 gloo ranks: one spawn runs every scenario in order; each rank records its error text -------------
def _mlp(out: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, out))


def _cfg(stage=2, **top):
    return {"zero_optimization": {"stage": stage, "agreement_timeout": 20}, "gradient_clipping": 1.0,
            "optimizer": {"params": {"lr": 0.01}}, **top}


def _train(engine, steps=2):
    for s in range(steps):
        g = torch.Generator().manual_seed(s * 10 + engine.rank)
        loss = engine(torch.randn(4, 16, generator=g).to(engine.dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine.full_state_dict()


def _model_mismatch(stage):
    def run(rank, world):
        return _train(zerocore.initialize(_mlp(4 if rank == 0 else 5), _cfg(stage)))
    return run


def _config_mismatch(change):
    def run(rank, world):
        cfg = _cfg(2)
        if rank == 1:
            change(cfg)
        return _train(zerocore.initialize(_mlp(), cfg))
    return run


def _meta_on_rank1(rank, world):
    if rank == 1:
        with torch.device("meta"):
            return zerocore.initialize(_mlp(), _cfg())
    return zerocore.initialize(_mlp(), _cfg())


def _agree_and_train(rank, world):
    return {"state": _train(zerocore.initialize(_mlp(), _cfg(2)))}


def _ddp_wrapped(rank, world):
    return zerocore.initialize(nn.parallel.DistributedDataParallel(_mlp()), _cfg())


def _stage3_destroy_and_rebuild(rank, world):
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    cfg = _cfg(3)
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_unit_min_params=1)
    with zerocore.initialize(model, cfg) as first:
        trained = _train(first)
    numels = [p.numel() for p in model.parameters()]
    second = zerocore.initialize(model, cfg)
    again = second.full_state_dict()
    return {"numels": numels, "same": all(torch.equal(again[k], v) for k, v in trained.items()),
            "more": _train(second, 1) is not None}


def _rank1_never_arrives(rank, world):
    if rank == 1:
        return "skipped"
    cfg = _cfg(2)
    cfg["zero_optimization"]["agreement_timeout"] = 3
    return zerocore.initialize(_mlp(), cfg)


def _forward_raises_on_rank1(stage, linger_s=0.0):
    """Rank 1's model raises in its second forward (a bad input) and the rank stays alive."""
    def run(rank, world):
        cfg = _cfg(stage)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_unit_min_params=1,
                                        stage3_divergence_timeout=5)
        engine = zerocore.initialize(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)), cfg)
        try:
            for step in range(3):
                x = torch.randn(4, 15 if (rank == 1 and step == 1) else 16)
                engine.backward(engine(x).pow(2).mean())
                engine.step()
        finally:
            if rank == 1:
                time.sleep(linger_s)  # alive, issuing nothing, while rank 0 waits
    return run


SCENARIOS = {
    "model_stage0": _model_mismatch(0),
    "model_stage2": _model_mismatch(2),
    "model_stage3": _model_mismatch(3),
    "lr": _config_mismatch(lambda c: c["optimizer"]["params"].update(lr=0.02)),
    "bf16": _config_mismatch(lambda c: c.update(bf16={"enabled": True})),
    "stage": _config_mismatch(lambda c: c["zero_optimization"].update(stage=3)),
    "bucket": _config_mismatch(lambda c: c["zero_optimization"].update(reduce_bucket_size=100)),
    "clip": _config_mismatch(lambda c: c.update(gradient_clipping=0.5)),
    "meta_rank1": _meta_on_rank1,
    "ddp": _ddp_wrapped,
    "agree": _agree_and_train,
    "stage3_rebuild": _stage3_destroy_and_rebuild,
    "stage3_forward_raises": _forward_raises_on_rank1(3),
    "absent": _rank1_never_arrives,  # last: the ranks' exchange counts differ after it
}


TIMEOUT_SCENARIOS = {"stage2_forward_raises": _forward_raises_on_rank1(2, linger_s=8.0)}


def _rank_entry(rank, world, init_file, out_dir, names, pg_timeout_s=None):
    import datetime

    torch.set_num_threads(1)
    kw = {"timeout": datetime.timedelta(seconds=pg_timeout_s)} if pg_timeout_s else {}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
    results = {}
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    results[name] = {"value": {**SCENARIOS, **TIMEOUT_SCENARIOS}[name](rank, world)}
            except Exception as e:  # noqa: BLE001 - the test asserts the type and wording
                results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"progress{rank}"), "a") as f:  # the parent's per-scenario deadline
                f.write(name + "\n")
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


STARTUP_S = 90  # spawning 2 ranks and importing torch (slow when the machine is loaded)
SCENARIO_S = 30  # each scenario, on every rank: a hang is caught within this


def _progress(tmp) -> int:
    done = 0
    for r in range(2):
        try:
            with open(os.path.join(tmp, f"progress{r}")) as f:
                done += len(f.read().split())
        except FileNotFoundError:
            pass
    return done


def _spawn(tmp, names, pg_timeout_s=None):
    ctx = start_ranks(_rank_entry, (2, os.path.join(tmp, "pg"), tmp, names, pg_timeout_s), 2)
    seen, deadline = 0, time.monotonic() + STARTUP_S + SCENARIO_S
    while not ctx.join(timeout=0.5):
        done = _progress(tmp)
        if done != seen:  # a scenario finished on some rank: the next one gets its own deadline
            seen, deadline = done, time.monotonic() + SCENARIO_S
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"a misuse scenario took over {SCENARIO_S} s on 2 ranks (a hang); "
                               f"{done} rank-scenarios had finished")
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(str(tmp_path_factory.mktemp("misuse")), list(SCENARIOS))


def _errors(results, name):
    errs = [r[name].get("error") for r in results]
    assert all(errs), f"{name}: a rank did not raise: {errs}"
    return errs


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ranks_with_different_models_are_refused_on_every_rank(two_ranks, stage):
    errs = _errors(two_ranks, f"model_stage{stage}")
    assert errs[0] == errs[1]  # the same error on every rank
    assert errs[0].startswith("AgreementError: zerocore.initialize: the ranks disagree")
    assert ("model: entry #3 (parameters, then buffers) differs (rank 0: 4, rank 1: 4 entries):\n"
            "    rank 0: parameter '2.weight' shape (4, 8) float32 requires_grad=True\n"
            "    rank 1: parameter '2.weight' shape (5, 8) float32 requires_grad=True") in errs[0]
    assert all(r[f"model_stage{stage}"]["seconds"] < 10 for r in two_ranks)


@pytest.mark.parametrize("name,key,values", [
    ("lr", "optimizer.params.lr", ("0.01", "0.02")),
    ("bf16", "bf16.enabled", ("false", "true")),
    ("stage", "zero_optimization.stage", ("2", "3")),
    ("bucket", "zero_optimization.reduce_bucket_size", ("500000000", "100")),
    ("clip", "gradient_clipping", ("1.0", "0.5")),
])
def test_ranks_with_different_configs_are_refused_naming_the_key(two_ranks, name, key, values):
    errs = _errors(two_ranks, name)
    assert errs[0] == errs[1]
    assert f"config: {key} differs:\n    rank 0: {values[0]}\n    rank 1: {values[1]}" in errs[0]
    assert "model:" not in errs[0]  # the models are the same


def test_a_rank_failing_its_own_checks_stops_every_rank(two_ranks):
    errs = _errors(two_ranks, "meta_rank1")
    assert errs[1].startswith("ValueError: zerocore.initialize: parameter '0.weight' is on the meta device")
    assert errs[0].startswith("AgreementError: zerocore.initialize: rank 1 failed its own checks, so every rank "
                              "stops here: ValueError: zerocore.initialize: parameter '0.weight' is on the meta")


def test_ddp_wrapped_model_is_refused(two_ranks):
    for err in _errors(two_ranks, "ddp"):
        assert ("TypeError: zerocore.initialize: the model is wrapped in torch.nn.parallel.DistributedDataParallel"
                in err and "pass the plain module (model.module)" in err)


def test_ranks_that_agree_train_identically(two_ranks):
    states = [r["agree"]["value"]["state"] for r in two_ranks]
    for k, v in states[0].items():
        assert torch.equal(v, states[1][k]), k


def test_stage3_model_destroyed_and_rebuilt_on_two_ranks(two_ranks):
    for r in two_ranks:
        assert "error" not in r["stage3_rebuild"], r["stage3_rebuild"].get("trace")
        v = r["stage3_rebuild"]["value"]
        assert v["numels"] == [16 * 64, 64, 64 * 4, 4] and v["same"] and v["more"]


def test_a_rank_that_never_arrives_is_named(two_ranks):
    r0 = two_ranks[0]["absent"]
    assert r0["error"].startswith("AgreementError: zerocore.initialize: rank 0 waited 3 s for every rank to reach "
                                  "zerocore.initialize; rank 1 did not arrive within 3 s")
    assert r0["seconds"] < 10
    assert two_ranks[1]["absent"]["value"] == "skipped"


def test_stage3_rank_raising_in_forward_is_named_at_once(two_ranks):
    r0, r1 = two_ranks[0]["stage3_forward_raises"], two_ranks[1]["stage3_forward_raises"]
    assert r1["error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x15 and 16x64)")
    assert r0["error"].startswith("DivergenceError: zerocore: ranks diverged under ZeRO stage 3")
    assert r0["error"].endswith("rank 1 stopped issuing collectives: its forward of micro-step 2 raised RuntimeError: "
                                "mat1 and mat2 shapes cannot be multiplied (4x15 and 16x64)")
    assert r0["seconds"] < 10


def test_stage2_rank_raising_in_forward_and_staying_alive_is_named_at_the_group_timeout(tmp_path):
    """The process group's own timeout (5 s here; zero_optimization.comm_timeout when zerocore creates
    the group) ends the wait, and the error names the rank that stopped and why."""
    r0, r1 = (r["stage2_forward_raises"] for r in _spawn(str(tmp_path), list(TIMEOUT_SCENARIOS), pg_timeout_s=5))
    assert r1["error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert r0["error"].startswith("CollectiveTimeout: zerocore: rank 0 timed out in a collective during its backward "
                                  "of micro-step 2 (")
    assert ("rank 1 stopped issuing collectives: its forward of micro-step 2 raised RuntimeError: mat1 and mat2 "
            "shapes cannot be multiplied (4x15 and 16x64)") in r0["error"]
    assert r0["seconds"] < 15


def test_a_group_zerocore_creates_gets_the_interactive_timeout(monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    seen = {}
    real = dist.init_process_group

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", spy)
    assert not dist.is_initialized()
    try:
        zerocore.initialize(small_model(), {"zero_optimization": {"comm_timeout": 45}})
        assert seen["timeout"].total_seconds() == 45
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert load_config({}).zero_optimization.comm_timeout == 120.0
    assert load_config({}).zero_optimization.stage3_divergence_timeout == 120.0


def test_leaving_the_with_block_on_an_error_releases_without_collectives():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}
    with pytest.raises(KeyError, match="user error"):
        with zerocore.initialize(model, cfg) as engine:
            one_step(engine, torch.randn(4, 64))
            raise KeyError("user error")
    assert engine.module is None  # released: the model is not owned any more
    with pytest.raises(ValueError, match=r"parameter '0.weight' has no values: its stage-3 engine was dropped without "
                                         r"engine.destroy\(\), or released after an error"):
        zerocore.initialize(model, cfg)
    small = small_model()
    with pytest.raises(KeyError):
        with zerocore.initialize(small, {"zero_optimization": {"stage": 2}}):
            raise KeyError("user error")
    zerocore.initialize(small, {"zero_optimization": {"stage": 2}})  # stages 0-2: values are whole, reusable
