"""Multi-rank plumbing for the checkpoint tests: train a case for some steps on gloo ranks,
save, resume (possibly at another world size and stage), and kill a rank in the middle of a
save. Results come back as one torch file per rank."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist

import zerocore
from dist_helpers import DTYPES, loss_fn, make_batch, make_model
from forked_ranks import start_ranks

GLOBAL_ROWS = 16  # samples per optimizer step, whatever the world size


@dataclasses.dataclass
class CkCase:
    name: str
    dtype: str = "fp32"
    model: str = "gpt"
    stage: int = 3  # the stage it is saved with (at world 4)
    gas: int = 2
    clip: float = 0.5
    lr: float = 1e-2
    fp16: dict = dataclasses.field(default_factory=dict)
    inject_inf: tuple[int, int] | None = None  # (step, rank): an Inf gradient on that rank at that step
    lr_drop_at: int = 2  # after this step the lr halves (a schedule the checkpoint must carry)

    def config(self, stage: int, world: int) -> dict:
        z = {"stage": stage, "reduce_bucket_size": 3000}
        if stage == 3 and self.model == "gpt":  # one unit per Block; only the tiniest vectors stay whole
            z.update(stage3_unit_classes=["Block"], stage3_param_persistence_threshold=40)
        return {"zero_optimization": z,
                "gradient_accumulation_steps": self.gas, "gradient_clipping": self.clip,
                "train_micro_batch_size_per_gpu": GLOBAL_ROWS // (self.gas * world),
                "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "weight_decay": 0.05}},
                "bf16": {"enabled": self.dtype == "bf16"}, "fp16": {"enabled": self.dtype == "fp16", **self.fp16}}


def train(engine, case: CkCase, rank: int, world: int, start: int, stop: int) -> dict:
    """Optimizer steps [start, stop) on the same global batches at any world size."""
    micro = GLOBAL_ROWS // (case.gas * world)
    rec = {"losses": [], "scales": [], "skipped": [], "lrs": [], "norms": []}
    for step in range(start, stop):
        x, y = make_batch(case.model, step, GLOBAL_ROWS, 0)
        for k in range(case.gas):
            lo = (k * world + rank) * micro
            xb, yb = x[lo:lo + micro], y[lo:lo + micro]
            if xb.is_floating_point():
                xb = xb.to(DTYPES[case.dtype])
            loss = loss_fn(case.model, engine(xb), yb)
            handle = None
            if case.inject_inf == (step, rank) and k == case.gas - 1:
                p = engine.module.blocks[0].mlp[0].weight if case.model == "gpt" else engine.module.out.weight
                handle = p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            engine.step()
            rec["losses"].append(loss.item())
        if step == case.lr_drop_at:
            engine.lr = engine.lr * 0.5
        rec["scales"].append(engine.loss_scale)
        rec["skipped"].append(engine.skipped_steps)
        rec["lrs"].append(engine.lr)
        rec["norms"].append(engine.global_grad_norm)
    return rec


def new_engine(case: CkCase, stage: int, seed: int = 0):
    return zerocore.initialize(make_model(case.model, seed), case.config(stage, dist.get_world_size()
                                                                          if dist.is_initialized() else 1))


def save_run(case: CkCase, root: str, rank: int, world: int) -> dict:
    """3 steps, save, 3 more (the uninterrupted run); then a fresh engine (other seed) loads the
    checkpoint at the same world and stage and trains the same 3 steps."""
    e = new_engine(case, case.stage)
    first = train(e, case, rank, world, 0, 3)
    e.save_checkpoint(os.path.join(root, case.name), client_state={"case": case.name, "step": 3})
    at3 = e.full_state_dict()
    rest = train(e, case, rank, world, 3, 6)
    out = {"first": first, "rest": rest, "at3": at3, "at6": e.full_state_dict(),
           "counters": (e.micro_steps, e.global_steps, e.optimizer_steps, e.skipped_steps)}
    e.reducer.remove_hooks()
    r = resume_run(case, root, case.stage, rank, world)
    out["same_world"] = r
    return out


def resume_run(case: CkCase, root: str, stage: int, rank: int, world: int) -> dict:
    e = new_engine(case, stage, seed=1)
    path, client = e.load_checkpoint(os.path.join(root, case.name))
    loaded = (e.micro_steps, e.global_steps, e.optimizer_steps, e.skipped_steps, e.lr, e.loss_scale)
    rest = train(e, case, rank, world, 3, 6)
    out = {"path": path, "client": client, "loaded": loaded, "rest": rest, "at6": e.full_state_dict(),
           "counters": (e.micro_steps, e.global_steps, e.optimizer_steps, e.skipped_steps)}
    e.reducer.remove_hooks()
    return out


def async_run(root: str, rank: int, world: int) -> dict:
    """An asynchronous save while training goes on: the checkpoint holds the state of the call."""
    case = CkCase("async", model="mlp", stage=2)
    e = new_engine(case, 2)
    train(e, case, rank, world, 0, 2)
    want = e.full_state_dict()
    handle = e.save_checkpoint(root, client_state={"a": 1}, async_save=True)
    train(e, case, rank, world, 2, 4)  # changes the state while the save is written
    path = handle.wait()
    e2 = new_engine(case, 3, seed=2)
    _, client = e2.load_checkpoint(root)
    got = e2.full_state_dict()
    e.save_checkpoint(root, tag="second", async_save=True)
    e2.reducer.remove_hooks()
    e3 = new_engine(case, 1, seed=2)
    e.load_checkpoint(root, tag="second")  # waits for the pending save first
    e3.load_checkpoint(root)
    out = {"path": path, "client": client, "equal": sorted(k for k in want if torch.equal(got[k], want[k])),
           "keys": sorted(want), "steps_after": (e.global_steps, e3.global_steps)}
    e.reducer.remove_hooks()
    e3.reducer.remove_hooks()
    return out


def kill_run(root: str, rank: int, world: int) -> dict:
    """Saves tag 'good' after one step, then rank ``world - 1`` kills itself (SIGKILL) in the
    middle of writing the next save."""
    from zerocore.checkpoint import save as save_mod

    case = CkCase("kill", model="mlp", stage=2)
    e = new_engine(case, 2)
    train(e, case, rank, world, 0, 1)
    e.save_checkpoint(root, tag="good")
    train(e, case, rank, world, 1, 2)
    victim = world - 1

    def hook(r, what):
        if r == victim and what.endswith("exp_avg"):
            os.kill(os.getpid(), signal.SIGKILL)

    save_mod.between_writes = hook
    e.save_checkpoint(root)  # never returns normally: a peer dies
    return {"saved": True}


def _entry(rank: int, world: int, init_file: str, out_dir: str, jobs: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for name, fn, args in jobs:
            try:
                results[name] = fn(*args, rank, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                break
            finally:  # written after each job: a later job may kill this rank
                torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if all("error" not in r for r in results.values()):
            dist.destroy_process_group()


def spawn(jobs: list, world: int, tmp_dir, timeout: float = 50) -> list[dict]:
    """Runs ``jobs`` ((name, fn, args) with ``fn(*args, rank, world)``) on ``world`` gloo ranks;
    returns each rank's {name: result}. Ranks may die (the kill test): whatever they wrote comes back."""
    tmp_dir = str(tmp_dir)
    ctx = start_ranks(_entry, (world, os.path.join(tmp_dir, "pg_init"), tmp_dir, jobs), world)
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in ctx.processes):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.2)
    for p in ctx.processes:
        p.join(5)
    out = []
    for r in range(world):
        path = os.path.join(tmp_dir, f"rank{r}.pt")
        out.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
    return out


def result(per_rank: list[dict], name: str) -> list[dict]:
    got = []
    for r, res in enumerate(per_rank):
        if name not in res:
            raise AssertionError(f"rank {r} has no result for {name!r} (died or timed out before it)")
        if "error" in res[name]:
            raise AssertionError(f"rank {r} failed in {name!r}:\n{res[name]['error']}")
        got.append(res[name])
    return got
