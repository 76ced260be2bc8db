"""Client optimizers: torch's Adam/AdamW read and run by the fused kernel (decay mode kept), any
other torch.optim.Optimizer (SGD with momentum, Adagrad, RMSprop) stepped on the flat fp32 shards
at stages 1-3 and with CPU offload, against the same optimizer in one process with the same
groups; its sharded state saved at world 2 and resumed at world 1; the combinations that cannot
work named at initialize."""
from __future__ import annotations

import pytest
import torch

import zerocore
from groups_helpers import GCase, check, data_parallel, spawn_gcases

CASES = [
    GCase("adamw_s2", stage=2, client="AdamW"),
    GCase("adam_l2_s1", stage=1, client="Adam"),
    GCase("sgd_s1", stage=1, client="SGD"),
    GCase("sgd_s2_buckets", stage=2, client="SGD", bucket=600, gas=2, clip=0.5),
    GCase("sgd_s3", model="nested", stage=3, client="SGD", units=True),
    GCase("adagrad_s1", stage=1, client="Adagrad"),
    GCase("adagrad_s2", stage=2, client="Adagrad"),
    GCase("adagrad_s3", model="nested", stage=3, client="Adagrad", units=True),
    GCase("rmsprop_s2", stage=2, client="RMSprop"),
    GCase("sgd_s2_cpu", stage=2, client="SGD", offload="cpu"),
    GCase("adagrad_s3_cpu", model="nested", stage=3, client="Adagrad", offload="cpu", units=True),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_gcases(CASES, 2, tmp_path_factory.mktemp("client_w2"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_client_optimizer_world2(world2, case):
    check(case, 2, world2[case.name])


def test_check_catches_a_missed_gradient():
    """``check`` allows fp32 rounding of the parameters (``allowed_delta_error``), and no more: the
    correct data-parallel run of sgd_s3 (the ranks' end state, bit for bit, on the machine measured) passes,
    the same run with one rank's part of one bias's gradient missed at the last step fails."""
    case = next(c for c in CASES if c.name == "sgd_s3")
    check(case, 2, [data_parallel(case, 2)])
    with pytest.raises(AssertionError, match=r"sgd_s3: mids\.1\.inner\.lin\.bias: delta error"):
        check(case, 2, [data_parallel(case, 2, drop=(case.steps - 1, "mids.1.inner.lin.bias"))])


@pytest.mark.parametrize("client, stage", [("SGD", 2), ("Adagrad", 3)])
def test_state_resumes_at_another_world_size(tmp_path, client, stage):
    """Saved after 3 of 6 steps at world 2, resumed at world 1 (same global batches): the end
    state is the uninterrupted run's."""
    d = tmp_path / "ckpt"
    model = "nested" if stage == 3 else "mlp"
    (tmp_path / "w2").mkdir()
    (tmp_path / "w1").mkdir()
    full = GCase("full", model=model, stage=stage, client=client, save=(3, str(d)), units=True)
    res = spawn_gcases([full], 2, tmp_path / "w2")["full"]
    assert "error" not in res[0], res[0].get("error")
    resumed = GCase("resumed", model=model, stage=1, client=client, micro=4, load=str(d))
    got = spawn_gcases([resumed], 1, tmp_path / "w1")["resumed"][0]
    assert "error" not in got, got.get("error")
    assert got["norms"] == pytest.approx(res[0]["norms"][3:], rel=1e-5)
    for name, want in res[0]["state"].items():
        torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-6)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_client_adam_modes_read():
    from zerocore.runtime.client_optimizer import classify
    from zerocore.config import load_config

    cfg = load_config({})
    m = _model()
    assert classify(torch.optim.AdamW(m.parameters()), cfg, None).decoupled is True
    assert classify(torch.optim.Adam(m.parameters()), cfg, None).decoupled is False
    assert classify(zerocore.FusedAdam(m.parameters(), adamw_mode=False), cfg, None).decoupled is False
    assert classify(torch.optim.Adam(m.parameters(), amsgrad=True), cfg, None).fused_adam is False  # torch runs it
    assert classify(torch.optim.SGD(m.parameters(), lr=0.1), cfg, None).fused_adam is False
    # DeepSpeed's Adam classes by name, without importing deepspeed
    FusedAdam = type("FusedAdam", (torch.optim.AdamW,), {"__module__": "deepspeed.ops.adam.fused_adam",
                                                          "adam_w_mode": False})
    assert classify(FusedAdam(m.parameters()), cfg, None).decoupled is False
    # a callable taking the parameters (DeepSpeed accepts one)
    c = classify(lambda ps: torch.optim.AdamW(ps, lr=0.5), cfg, lambda: list(m.parameters()))
    assert c.optimizer.defaults["lr"] == 0.5


@pytest.mark.parametrize("cfg, opt, match", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     lambda m: torch.optim.SGD(m.parameters(), lr=0.1), r"offload_optimizer.device: 'nvme'.*SGD"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     lambda m: torch.optim.Adagrad(m.parameters()), r"offload_optimizer.ratio.*Adagrad"),
    ({}, lambda m: "sgd", "optimizer must be a torch.optim.Optimizer"),
])
def test_what_cannot_work_is_named(cfg, opt, match):
    m = _model()
    with pytest.raises((ValueError, TypeError), match=match):
        zerocore.initialize(m, cfg, optimizer=opt(m))


def test_passed_optimizer_wins_over_the_config_section_with_a_warning():
    """DeepSpeed 0.19 trains with the passed optimizer and ignores the config's section: so does zerocore,
    and says so."""
    m = _model()
    with pytest.warns(UserWarning, match="'optimizer' section too; the passed one is used"):
        e = zerocore.initialize(m, {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}},
                                optimizer=torch.optim.SGD(m.parameters(), lr=0.01))
    assert e.get_lr() == [0.01]
    e.destroy()


def test_untested_optimizer_key_accepted():
    m = _model()
    e = zerocore.initialize(m, {"zero_allow_untested_optimizer": True}, optimizer=torch.optim.SGD(m.parameters(), 0.1))
    e.backward(e(torch.randn(2, 4)).sum())
    e.step()
    e.destroy()
