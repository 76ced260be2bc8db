"""One Lightning run under torchrun (or alone): writes a JSON with rank 0's losses, learning rates,
the gradient norms of the optimizer steps and the final weights.
argv: strategy out.json [steps] [accumulate] [ckpt_every] [resume_dir or -] [samples]. With
samples / (8 x ranks) batches per rank not a multiple of accumulate, each epoch ends with a short
accumulation window. LIGHTNING_COMPILE=<a dynamo backend> in the environment: the LightningModule is given to
fit() compiled (torch.compile(model, backend=...)), as Lightning takes one for DDP. LIGHTNING_EVAL=1: validate() before
fit, test() and predict() after it (each rank's mean loss and the predictions reported), and with a checkpoint
(ckpt_every) validate(ckpt_path=) of the first one after fit."""
import json
import os
import sys

import torch
from torch import nn

import lightning.pytorch as pl

import zerocore.integrations.lightning  # noqa: F401  (registers the zerocore_* strategies)

from ddp_teardown import end_reference_run  # (this folder: the script's own, first on sys.path)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.losses, self.lrs, self.norms = [], [], []
        self._steps_seen = 0
        self.evals, self.eval_engines = {}, {}

    def configure_model(self):
        if hasattr(self, "body"):
            return
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 5))

    def on_train_start(self):
        self.partitioned = sum(p.numel() == 0 for p in self.parameters())  # stage 3: the empty stand-ins

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.body(x), y)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, _):
        return self._eval("val", batch)

    def test_step(self, batch, _):
        return self._eval("test", batch)

    def predict_step(self, batch, _):
        return self.body(batch[0])

    def _eval(self, kind, batch):
        x, y = batch
        loss = nn.functional.cross_entropy(self.body(x), y)
        self.evals.setdefault(kind, []).append(loss.item())
        # what the run holds then: its engine trains nothing (no master, no optimizer moments)
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            rep = engine.memory_report()
            self.eval_engines[kind] = {"trains": engine.trains, "state": rep["master"] + rep["exp_avg"] +
                                       rep["exp_avg_sq"] + rep["grads"]}
        return loss

    def on_before_optimizer_step(self, optimizer):
        if getattr(self.trainer.strategy, "engine", None) is None:  # DDP: the averaged gradients, before clipping
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None and self.trainer.global_step > self._steps_seen:  # the engine stepped: its norm
            self.norms.append(engine.get_global_grad_norm())
        self._steps_seen = self.trainer.global_step

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
        decay = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.2, total_iters=20)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[4])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n=320):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 24, generator=g)
    y = (x[:, :5] * 3).argmax(-1)
    return torch.utils.data.TensorDataset(x, y)


def strategy_of(name: str):
    """The strategy by its registry name; at stage 3 with ``stage3_param_persistence_threshold`` 0: every weight of
    this net is under the default threshold, which would keep them all whole (nothing partitioned)."""
    if not name.startswith("zerocore_stage_3"):
        return name
    from lightning.pytorch.strategies import StrategyRegistry

    from zerocore.integrations.lightning import ZerocoreStrategy

    return ZerocoreStrategy(config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
                            **StrategyRegistry[name]["init_params"])


class CountingSummary(pl.callbacks.ModelSummary):
    """Lightning's model summary as fit starts (printed on rank 0), its parameter counts kept for the result."""

    counts = {}

    def summarize(self, summary_data, total_parameters, trainable_parameters, *args, **kwargs):
        super().summarize(summary_data, total_parameters, trainable_parameters, *args, **kwargs)
        self.counts.update(total=total_parameters, trainable=trainable_parameters)


def main():
    strategy, out = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    acc = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    ckpt_every = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    resume = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    samples = int(sys.argv[7]) if len(sys.argv) > 7 else 320
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    callbacks = [CountingSummary()]
    if ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.dirname(out) + "/ckpt", every_n_train_steps=ckpt_every,
                                                      save_top_k=-1, filename="s{step}"))
    trainer = pl.Trainer(strategy=strategy_of(strategy), accelerator="cpu", devices=world, max_steps=steps,
                         accumulate_grad_batches=acc, gradient_clip_val=0.5, logger=False,
                         enable_checkpointing=bool(ckpt_every), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    net = model = Net()
    if os.environ.get("LIGHTNING_COMPILE"):
        model = torch.compile(net, backend=os.environ["LIGHTNING_COMPILE"])
    loader = torch.utils.data.DataLoader(data(samples), batch_size=8, shuffle=False)
    evaluate = os.environ.get("LIGHTNING_EVAL") == "1"
    held_out = torch.utils.data.DataLoader(torch.utils.data.Subset(data(360), range(320, 360)), batch_size=8)
    if evaluate:
        trainer.validate(model, held_out)
    trainer.fit(model, loader, ckpt_path=resume)
    # the zerocore strategy destroyed its engine at the end of fit: the model holds the full weights
    assert getattr(trainer.strategy, "engine", None) is None
    partitioned = getattr(net, "partitioned", 0)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    result = {}
    if evaluate:
        trainer.test(model, held_out)
        result["predictions"] = torch.cat(trainer.predict(model, held_out)).tolist()
        if ckpt_every:
            first = sorted(os.listdir(os.path.dirname(out) + "/ckpt"))[0]
            net.evals["val_ckpt"] = []
            before = len(net.evals["val"])
            trainer.validate(model, held_out, ckpt_path=os.path.dirname(out) + "/ckpt/" + first)
            net.evals["val_ckpt"] = net.evals["val"][before:]
            del net.evals["val"][before:]
            # the model holds the trained weights again? (validate from a checkpoint loads that checkpoint's)
            result["after_ckpt_validate"] = {k: v.reshape(-1).tolist() for k, v in net.state_dict().items()}
        result.update(evals=net.evals, eval_engines=net.eval_engines)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": net.losses, "lrs": net.lrs, "grad_norms": net.norms,
                       "global_step": trainer.global_step, "summary": CountingSummary.counts,
                       "partitioned": partitioned,
                       "weights": {k: v.reshape(-1).tolist() for k, v in sd.items()}, **result}, f)
    if strategy == "ddp":
        end_reference_run()


if __name__ == "__main__":
    main()
