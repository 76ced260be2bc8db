"""Two training runs in one fresh process through one trainer integration (issue 33): host memory
(RSS) after each, and what is left of the first run's engine once the trainer lets go of it, with
Python's cyclic collector off (reference counting alone, as between the collector's runs).
Prints one JSON line. World 1, no torchrun.

    python tests/integrations/memory_run.py hf|lightning|accelerate STAGE

The model has 27.3M trainable parameters (26 x Linear(1024, 1024), or a 2-layer Llama of width
1024): 218 MB of Adam moments alone, several hundred MB of engine state in all, so an engine kept
alive across runs is far above RSS noise.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import weakref

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from memory_helpers import rss, state_tensor_refs  # noqa: E402

WIDTH, LAYERS = 1024, 26
STEPS = 2  # optimizer steps a run, accumulation 2


def engine_refs(engine) -> list[weakref.ref]:
    """Weak references to the engine and to every tensor of its state: what must be freed with it."""
    return [weakref.ref(engine)] + state_tensor_refs(engine)


def alive(refs) -> int:
    return sum(r() is not None for r in refs)


def zerocore_in_cycles(allowed: tuple[str, ...] = ()) -> list[str]:
    """Types of zerocore's objects the cyclic collector would have to free (modules in ``allowed``
    excepted); the collector runs here once, with DEBUG_SAVEALL, and is left off."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                        if isinstance(type(o).__dict__.get("__module__"), str)
                        and type(o).__module__.startswith("zerocore") and not type(o).__module__.startswith(allowed)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def mib(n: int) -> float:
    return n / 2**20


def linear_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def batches(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))


# -- Hugging Face Trainer ---------------------------------------------------------------------
def hf(stage: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from hf_run import Tokens
    from zerocore.integrations.transformers import ZeroTrainer

    def trainer(model):
        args = TrainingArguments(output_dir=os.path.join(os.getcwd(), "hf_out"), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3, use_cpu=True,
                                 save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1,
                                 dataloader_num_workers=0)
        return ZeroTrainer(model=model, args=args, train_dataset=Tokens(4 * 2 * STEPS),
                           zerocore_config={"zero_optimization": {"stage": stage}})

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=WIDTH, intermediate_size=3072,
                                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                            max_position_embeddings=64, tie_word_embeddings=False))

    gc.collect()
    gc.disable()
    before = rss()
    model = llama()
    out = {"params": sum(p.numel() for p in model.parameters())}
    t = trainer(model)
    t.train()
    first = rss()
    refs = engine_refs(t.zerocore_engine)
    t.train()  # train() again: the same engine goes on, as the same Trainer's optimizer does on DDP
    out["second_train_same_engine"] = t.zerocore_engine is refs[0]()
    again = rss()
    del t
    out["first_engine_alive_after_dropping_trainer"] = alive(refs)  # the model still referenced
    del model
    out["zerocore_in_cycles"] = zerocore_in_cycles()
    model = llama()
    t = trainer(model)  # a second Trainer, for a new model
    t.train()
    second = rss()
    out.update(run_state_mib=mib(first - before), train_again_minus_first_mib=mib(again - first),
               second_minus_first_mib=mib(second - first))
    return out


# -- Lightning ----------------------------------------------------------------------------------
def lightning(stage: int) -> dict:
    import lightning.pytorch as pl

    import zerocore.integrations.lightning  # noqa: F401  (registers the strategies)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = linear_stack()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class AtEnd(pl.Callback):  # the engine is the strategy's only while the run lasts
        def on_train_end(self, trainer, pl_module):
            self.refs = engine_refs(trainer.strategy.engine)
            self.rss = rss()

    def fit(model):
        at_end = AtEnd()
        trainer = pl.Trainer(strategy=f"zerocore_stage_{stage}", accelerator="cpu", devices=1, max_steps=STEPS,
                             accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[at_end])
        trainer.fit(model, torch.utils.data.DataLoader(batches(4 * 2 * STEPS), batch_size=4))
        return trainer, at_end

    model = Net()
    out = {"params": sum(p.numel() for p in model.parameters())}
    gc.collect()
    gc.disable()
    before = rss()
    trainer1, end1 = fit(model)
    first = rss()
    # Lightning's Trainer, module and strategy hold each other: the engine had to go at teardown
    out["first_engine_alive_after_fit"] = alive(end1.refs)
    trainer2, end2 = fit(model)  # a second fit of the same model, the first Trainer still referenced
    second = rss()
    out["model_is_whole"] = all(p.numel() > 0 and p.grad is None for p in model.parameters())
    del trainer1, trainer2, end1.refs, end2.refs
    # the strategy, its precision plugin and optimizer face sit in Lightning's own cycles
    out["zerocore_in_cycles"] = zerocore_in_cycles(allowed=("zerocore.integrations",))
    # the engine's state is there until the end of training (teardown frees it): measured there
    out.update(run_state_mib=mib(end1.rss - before), second_minus_first_mib=mib(second - first),
               second_minus_first_in_run_mib=mib(end2.rss - end1.rss))
    return out


# -- Accelerate ---------------------------------------------------------------------------------
def accelerate(stage: int) -> dict:
    from zerocore.integrations.accelerate import ZeroAccelerator

    def run():
        model = linear_stack()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        acc = ZeroAccelerator(cpu=True, gradient_accumulation_steps=2,
                              zerocore_config={"zero_optimization": {"stage": stage}})
        model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(batches(4 * 2 * STEPS), batch_size=4))
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
        return acc, model, opt, loader

    gc.collect()
    gc.disable()
    before = rss()
    acc, model, opt, loader = run()
    first = rss()
    refs = engine_refs(acc.zerocore_engine)
    del acc, model, opt, loader
    out = {"first_engine_alive_after_drop": alive(refs), "zerocore_in_cycles": zerocore_in_cycles()}
    acc, model, opt, loader = run()  # a second ZeroAccelerator, one after the other
    second = rss()
    refs = engine_refs(acc.zerocore_engine)
    acc.free_memory()  # as Accelerate frees DeepSpeed's engine; the prepared model stays referenced
    out["engine_tensors_alive_after_free_memory"] = alive(refs[1:])
    out["model_is_whole_after_free_memory"] = all(p.numel() > 0 for p in model.module.parameters())
    out.update(run_state_mib=mib(first - before), second_minus_first_mib=mib(second - first))
    return out


def main() -> None:
    which, stage = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps({"hf": hf, "lightning": lightning, "accelerate": accelerate}[which](stage)))


if __name__ == "__main__":
    main()
