"""``save_pretrained`` of a Transformers model a stage-3 engine holds: its partitioned parameters are empty tensors
outside a forward, so without a ``state_dict`` it refuses (naming the first one and how to save the full weights)
instead of writing 0-element weights found only at load time; given the engine's ``full_state_dict()`` it saves a
model that loads with the trained values; below stage 3, and after ``destroy()``, it saves as Transformers does.
One rank, in this process."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import zerocore  # noqa: E402


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _trained(stage: int):
    model = _model()
    engine = zerocore.initialize(model, {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine, model


def _same(saved_dir, state) -> None:
    back = LlamaForCausalLM.from_pretrained(saved_dir).state_dict()
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_stage3_refuses_empty_weights_and_saves_the_full_state(tmp_path):
    engine, model = _trained(3)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.save_pretrained\(.*\) at ZeRO stage 3 would write \d+ "
                                         r"partitioned parameters as empty tensors "
                                         r"\('model.embed_tokens.weight' first\).*engine.full_state_dict\(\)"):
        model.save_pretrained(tmp_path / "empty")
    assert not (tmp_path / "empty" / "model.safetensors").exists()
    state = engine.full_state_dict()
    model.save_pretrained(tmp_path / "full", state_dict=dict(state))  # (Transformers edits the dict it is given)
    _same(tmp_path / "full", state)
    engine.destroy()  # the model whole again, its own class: saved as Transformers saves
    model.save_pretrained(tmp_path / "after")
    _same(tmp_path / "after", state)


def test_below_stage3_saves_as_transformers_does(tmp_path):
    engine, model = _trained(2)
    model.save_pretrained(tmp_path / "s2")
    _same(tmp_path / "s2", engine.full_state_dict())
    engine.destroy()
