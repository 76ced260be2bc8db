"""A training script written the way DeepSpeed's examples are (argparse + add_config_arguments,
init_distributed, initialize with training_data, engine.backward / engine.step, save_checkpoint),
run under torchrun with the real DeepSpeed or with zerocore.deepspeed: ZC_FACE=deepspeed|zerocore
picks the import, nothing else differs.

Synthetic CIFAR-shaped data (no network). Writes, per rank, a JSON record of every micro-step's
loss and every boundary's lr and gradient norm; with --save_at it saves a checkpoint after that
many optimizer steps and, at the end, builds a fresh model, loads it and replays the steps after
it (the resumed losses go to the record too). ``--cases`` runs several configurations in one
process (each a JSON object of argument overrides with a "name"), each into ``<out>/<name>/``.

``--bf16`` trains in bfloat16 (``"bf16": {"enabled": true}``, whose ``check_grad_overflow`` is on by
default); ``--inf_at N`` puts an Inf into one gradient element on every rank at optimizer step N (the
boundary index, from 0), and the record then also holds each boundary's ``skipped`` (engine.skipped_steps).
"""
import argparse
import datetime
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

if os.environ.get("ZC_FACE") == "zerocore":
    import zerocore.deepspeed as deepspeed
else:
    import deepspeed


class Net(nn.Module):  # a small CIFAR-style conv net
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.conv2 = nn.Conv2d(6, 8, 3)
        self.fc1 = nn.Linear(8 * 2 * 2, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        x = torch.flatten(x, 1)
        return self.fc2(self.norm(F.relu(self.fc1(x))))


def dataset(n=256):
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 10, (n,), generator=g))


def ds_config(args):
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
           "steps_per_print": 1000, "wall_clock_breakdown": False,
           "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000}}
    if args.clip is not None:  # None: the key left out (DeepSpeed's default applies)
        cfg["gradient_clipping"] = args.clip
    if args.bf16:
        cfg["bf16"] = {"enabled": True}  # check_grad_overflow: its default (True in both) unless given
        if args.check_grad_overflow is not None:
            cfg["bf16"]["check_grad_overflow"] = bool(args.check_grad_overflow)
    if args.stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 500})
    if args.client == "none":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.99], "eps": 1e-8,
                                                        "weight_decay": 0.01, "torch_adam": True}}
    else:
        cfg["zero_allow_untested_optimizer"] = True
    if args.sched == "warmup_decay":
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                                "warmup_num_steps": 3, "total_num_steps": 12}}
    elif args.sched == "warmup":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                           "warmup_num_steps": 4}}
    return cfg


def build(args, model_parameters=None):
    torch.manual_seed(0)
    if args.stage == 3 and args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=ds_config(args)):
            net = Net()
    else:
        net = Net()
        if args.round_init:
            # bf16: the initial values made bfloat16-representable. DeepSpeed casts the module to bf16 in
            # initialize and builds its fp32 master from the cast values; zerocore's fp32 master is cut
            # from the fp32 values it is given, before they are rounded (runtime/engine.py _add_group).
            # The masters then differ by the rounding, the bf16 weights by an ulp here and there after the
            # first update; with values already representable both start from the same master.
            with torch.no_grad():
                for p in net.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in net.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"model_parameters": groups if args.groups else filter(lambda p: p.requires_grad, net.parameters())}
    if args.client == "adamw":
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
        kwargs = {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}
    elif args.client == "sgd":
        kwargs = {"optimizer": torch.optim.SGD(groups, lr=args.lr, momentum=0.9)}
    return deepspeed.initialize(args=args, model=net, training_data=dataset(), **kwargs)


def micro_batches(loader):
    while True:  # the loader's order is fixed (DistributedSampler without set_epoch): a replay sees the same
        yield from loader


def lr_of(engine):
    return engine.get_lr()[0] if hasattr(engine, "get_lr") else engine.lr


def model_dtype(engine):
    """The dtype the module's parameters hold: both DeepSpeed and zerocore cast the module to bfloat16
    under bf16 and DeepSpeed's forward casts no inputs (only fp16.auto_cast would): a float32 input into
    a bf16 Conv2d raises "Input type (float) and bias type (c10::BFloat16) should be the same" on the CPU
    too, so the inputs are cast to it. Stage-3 parameters are placeholders between gathers in both, but
    keep their dtype."""
    return next(engine.module.parameters()).dtype


def inf_hook(grad):
    """An Inf in one element of the gradient (tensor hooks run before the gradient is accumulated, so
    each library's own accumulation/reduction hooks see it)."""
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def train(engine, loader, steps, first_step, record, save_dir=None, save_at=None, inf_at=None):
    it = micro_batches(loader)
    for _ in range(first_step * engine.gradient_accumulation_steps()):
        next(it)
    dtype = model_dtype(engine)
    # The Inf goes into fc1.weight's gradient through a tensor hook on the module's own Parameter object,
    # registered before the boundary's first backward and removed after its last; one element, every rank.
    # Both libraries keep that object as the autograd leaf the forward uses, at every stage (at stage 3
    # only what it holds changes: DeepSpeed swaps its .data, zerocore resizes the flat buffer it views),
    # and a tensor hook runs before AccumulateGrad writes .grad, which is where both take the gradient
    # from (DeepSpeed's post-accumulate-grad hooks at stages 1/2/3, deepspeed.utils.torch.register_grad_hook;
    # zerocore's reducer and stage-3 unit hooks). Checked: the boundary's norm is inf in both, at stages 1,
    # 2 and 3, with and without zero.Init. A hook rather than an Inf in the loss: one bad element among
    # finite ones, the case an overflow check must catch.
    target = engine.module.fc1.weight
    for step in range(first_step, steps):
        handle = target.register_hook(inf_hook) if inf_at is not None and step == inf_at else None
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(it)
            if x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            # the loss in fp32 from the (bf16) logits: the same loss function in both, and labels unchanged
            loss = F.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            record["loss"].append(loss.item())
        if handle is not None:
            handle.remove()
        assert boundary
        if save_at is not None and step + 1 == save_at:
            # saved before the record's reads below (the values they read are the same either way): a
            # checkpoint taken right after a skipped boundary, before anything else asked, holds its counts
            engine.save_checkpoint(save_dir, client_state={"step": step + 1})
        record["lr"].append(lr_of(engine))
        record["norm"].append(float(engine.get_global_grad_norm()))
        record["samples"].append(engine.global_samples)
        if inf_at is not None:
            record.setdefault("skipped", []).append(int(engine.skipped_steps))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--sched", default="none")
    parser.add_argument("--client", default="none")
    parser.add_argument("--groups", action="store_true")
    parser.add_argument("--save_at", type=int, default=None)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--inf_at", type=int, default=None)
    parser.add_argument("--check_grad_overflow", type=int, default=None)  # with --bf16; None: the key left out
    parser.add_argument("--round_init", action="store_true")
    parser.add_argument("--zero_init", type=int, default=1)  # 0: stage 3 built outside deepspeed.zero.Init
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default='[{"name": "run"}]')
    parser = deepspeed.add_config_arguments(parser)
    base = parser.parse_args()
    # 120 s, not gloo's default: a rank that never joins a collective (DeepSpeed's own stage-3 trace check
    # once hung so in CI) fails the run in two minutes instead of costing CI ten
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    for case in json.loads(base.cases):
        args = argparse.Namespace(**{**vars(base), **case})
        args.out = os.path.join(base.out, case["name"])
        run_case(args)
    deepspeed.comm.barrier()
    # an exiting rank whose gloo group is still alive sometimes aborts in its destructor
    torch.distributed.destroy_process_group()


def run_case(args):
    args.deepspeed_config = os.path.join(args.out, "ds_config.json")
    rank = deepspeed.comm.get_rank()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(args.deepspeed_config, "w") as f:
            json.dump(ds_config(args), f)
    deepspeed.comm.barrier()
    engine, _, loader, _ = build(args)
    record = {"loss": [], "lr": [], "norm": [], "samples": [], "resumed_loss": []}
    ckpt = os.path.join(args.out, "ckpt")
    train(engine, loader, args.steps, 0, record, ckpt, args.save_at, args.inf_at)
    if args.save_at is not None:
        engine2, _, loader2, _ = build(args)
        path, client = engine2.load_checkpoint(ckpt)
        assert client["step"] == args.save_at, client
        resumed = {"loss": [], "lr": [], "norm": [], "samples": []}
        train(engine2, loader2, args.steps, args.save_at, resumed, inf_at=args.inf_at)
        record["resumed_loss"] = resumed["loss"]
        record["resumed_lr"] = resumed["lr"]
        if "skipped" in resumed:
            record["resumed_skipped"] = resumed["skipped"]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
