"""A training script written the way DeepSpeed's examples are (argparse + add_config_arguments,
init_distributed, initialize with training_data, engine.backward / engine.step, save_checkpoint),
run under torchrun with the real DeepSpeed or with zerocore.deepspeed: ZC_FACE=deepspeed|zerocore
picks the import, nothing else differs.

Synthetic CIFAR-shaped data (no network). Writes, per rank, a JSON record of every micro-step's
loss and every boundary's lr and gradient norm; with --save_at it saves a checkpoint after that
many optimizer steps and, at the end, builds a fresh model, loads it and replays the steps after
it (the resumed losses go to the record too). ``--cases`` runs several configurations in one
process (each a JSON object of argument overrides with a "name"), each into ``<out>/<name>/``.
"""
import argparse
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
    if args.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config(args)):
            net = Net()
    else:
        net = Net()
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


def train(engine, loader, steps, first_step, record, save_dir=None, save_at=None):
    it = micro_batches(loader)
    for _ in range(first_step * engine.gradient_accumulation_steps()):
        next(it)
    for step in range(first_step, steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(it)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            record["loss"].append(loss.item())
        assert boundary
        record["lr"].append(lr_of(engine))
        record["norm"].append(float(engine.get_global_grad_norm()))
        record["samples"].append(engine.global_samples)
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(save_dir, client_state={"step": step + 1})


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
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default='[{"name": "run"}]')
    parser = deepspeed.add_config_arguments(parser)
    base = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
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
    train(engine, loader, args.steps, 0, record, ckpt, args.save_at)
    if args.save_at is not None:
        engine2, _, loader2, _ = build(args)
        path, client = engine2.load_checkpoint(ckpt)
        assert client["step"] == args.save_at, client
        resumed = {"loss": [], "lr": [], "norm": [], "samples": []}
        train(engine2, loader2, args.steps, args.save_at, resumed)
        record["resumed_loss"] = resumed["loss"]
        record["resumed_lr"] = resumed["lr"]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
