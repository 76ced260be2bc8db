"""A process group of one rank where the launcher started several (``WORLD_SIZE`` > 1) is refused, naming both:
each process would otherwise train a model of its own, nothing sharded or averaged, and nothing would say so.
The rule's cases are DeepSpeed's (its ``_contradicting_single_rank_pg_error``, which the face carries)."""
from __future__ import annotations

import pytest
import torch

import zerocore
from zerocore.comm.group import contradicting_single_rank_error
from zerocore.deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error


@pytest.mark.parametrize("check", [contradicting_single_rank_error, _contradicting_single_rank_pg_error])
def test_the_rule(check):
    msg = check(1, None, {"WORLD_SIZE": "8"})
    assert "WORLD_SIZE=8" in msg and "init_distributed" in msg and "1 rank" in msg
    for env in ({"WORLD_SIZE": "1"}, {}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "not-an-int"}, {"WORLD_SIZE": None}):
        assert check(1, None, env) is None, env
    assert check(8, None, {"WORLD_SIZE": "8"}) is None  # the group shards
    assert check(1, object(), {"WORLD_SIZE": "8"}) is None  # a group the caller chose


def test_an_engine_without_a_group_under_a_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)  # (with RANK too, zerocore would initialize the group itself)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4, but its process group has 1 rank"):
        zerocore.initialize(torch.nn.Linear(3, 3), {"train_micro_batch_size_per_gpu": 1})
    monkeypatch.setenv("WORLD_SIZE", "1")
    zerocore.initialize(torch.nn.Linear(3, 3), {"train_micro_batch_size_per_gpu": 1}).destroy()
