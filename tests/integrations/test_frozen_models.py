"""The models a trainer runs but does not train (zerocore/integrations/transformers/frozen_models.py), on one rank:
which attributes are wrapped at stage 3 and which stay as they are, the config they get (TRL's prepare_deepspeed's:
no optimizer, schedule or optimizer offload), and sync_ref_model refused at stage 3. Two ranks, through TRL's own
trainers and beside DDP: test_integration_trl_rl.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import TrainingArguments  # noqa: E402

from zerocore.integrations._wrapping import EngineModule  # noqa: E402
from zerocore.integrations.transformers.frozen_models import frozen_config, shard_frozen_models  # noqa: E402


class _Trainer:
    """What shard_frozen_models reads of a trainer: its config, its arguments, the models it holds."""

    def __init__(self, tmp_path, stage: int, sync: bool = False, **models):
        self.zerocore_config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
            "stage": stage, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": {"type": "WarmupLR"}}
        self.args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                      per_device_train_batch_size=2)
        self.args.sync_ref_model = sync  # (a TRL config's field)
        for name, value in models.items():
            setattr(self, name, value)


def _net(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


class _WithHead(torch.nn.Sequential):
    """A model with output embeddings (a Transformers model's ``get_output_embeddings``): its last Linear."""

    def get_output_embeddings(self):
        return self[-1]


def test_stage3_wraps_reference_reward_and_teacher_models(tmp_path):
    def score(completions, **kw):  # a reward function that is not a model: left as it is
        return [0.0 for _ in completions]

    ref, reward = _net(0), _net(2)
    torch.manual_seed(1)
    teacher = _WithHead(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    want = {name: m(torch.ones(1, 8)).detach() for name, m in (("ref", ref), ("teacher", teacher), ("reward", reward))}
    trainer = _Trainer(tmp_path, 3, ref_model=ref, teacher_model=teacher, reward_funcs=[score, reward])
    engines = shard_frozen_models(trainer)
    assert len(engines) == 3 and all(not e.trains for e in engines)
    assert isinstance(trainer.ref_model, EngineModule) and isinstance(trainer.teacher_model, EngineModule)
    assert trainer.reward_funcs[0] is score and isinstance(trainer.reward_funcs[1], EngineModule)
    got = {"ref": trainer.ref_model, "teacher": trainer.teacher_model, "reward": trainer.reward_funcs[1]}
    for name, m in got.items():
        with torch.no_grad():
            assert torch.equal(m(torch.ones(1, 8)), want[name]), name
    # partitioned (one rank: its chunk is the whole), but the teacher's output embeddings: TRL's distillation loss
    # reads that weight after the teacher's forward
    assert all(p.numel() == 0 for name in ("ref", "reward") for p in got[name].parameters())
    assert {n: p.numel() for n, p in teacher.named_parameters()} == {"0.weight": 0, "0.bias": 0, "2.weight": 32,
                                                                      "2.bias": 2}
    for e in engines:
        assert e.memory_report()["master"] == 0 and e.optimizer.param_groups[0]["params"] == []
        e.destroy()


def test_below_stage3_models_stay_whole(tmp_path):
    ref = _net()
    trainer = _Trainer(tmp_path, 2, ref_model=ref)
    assert shard_frozen_models(trainer) == [] and trainer.ref_model is ref


def test_frozen_config_is_prepare_deepspeeds(tmp_path):
    trainer = _Trainer(tmp_path, 3)
    cfg = frozen_config(trainer.zerocore_config, trainer.args, _net())
    assert "optimizer" not in cfg and "scheduler" not in cfg and "offload_optimizer" not in cfg["zero_optimization"]
    assert cfg["train_micro_batch_size_per_gpu"] == 2  # "auto" filled from the arguments
    assert "optimizer" in trainer.zerocore_config  # the trainer's own config is left as it was


def test_sync_ref_model_is_refused_at_stage3(tmp_path):
    trainer = _Trainer(tmp_path, 3, sync=True, ref_model=_net())
    with pytest.raises(ValueError, match="sync_ref_model=True with zero_optimization.stage 3"):
        shard_frozen_models(trainer)
