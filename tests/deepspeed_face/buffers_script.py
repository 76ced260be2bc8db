"""A bf16 model whose forward reads fp32 buffers the way Hugging Face's rotary embedding reads
``inv_freq`` (upcast to fp32, angles = position x inv_freq, cos in fp32), trained under torchrun
with the real DeepSpeed or zerocore.deepspeed (ZC_FACE picks, as in train_script.py). Rounding
``inv_freq`` to bf16 moves the angles of the later positions by up to a radian, so the losses
show which dtype each buffer trained in. Writes, per rank, the buffers' dtypes after initialize
and every micro-step's loss. ``--cases``: JSON list of {"name", "stage", "data_types", "zero_init"}."""
import argparse
import datetime
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

if os.environ.get("ZC_FACE") == "zerocore":
    import zerocore.deepspeed as deepspeed
else:
    import deepspeed

DIM, SEQ = 16, 48


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        # fp32 frequencies as Llama's (base 10000): rounding to bf16 changes them by up to 2^-9 relative
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)) * 3.7,
                             persistent=False)

    def forward(self, h):
        pos = torch.arange(h.shape[1], dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq.float()[None, :] * 40.0
        return h * torch.cat([angles.cos(), angles.sin()], dim=-1).to(h.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.rotary = Rotary()
        self.register_buffer("scale", torch.tensor([1.0 + 1.0 / 3.0]))  # 1.333.. (bf16: 1.3359375)
        self.out = nn.Linear(DIM, 4)

    def forward(self, x):
        h = self.rotary(self.inp(x))
        # scaled in fp32 whatever the buffer's dtype, back to the layers' dtype for the next matmul
        return self.out((h.float() * self.scale.float()).to(h.dtype))


def ds_config(stage, data_types):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "bf16": {"enabled": True}, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if data_types is not None:
        cfg["data_types"] = data_types
    return cfg


def run_case(case, out, rank):
    torch.manual_seed(0)
    cfg = ds_config(case["stage"], case.get("data_types"))
    if case.get("zero_init"):
        # Init makes torch.tensor's scale bf16 as it is created (in both), inv_freq (from an integer
        # arange, then .float()) fp32, and the parameters bf16 already: the same values in both
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            net = Net()
    else:
        net = Net()
        with torch.no_grad():  # bf16-representable initial weights: the same fp32 master in both (train_script.py)
            for p in net.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    record = {"dtypes": {n: str(b.dtype) for n, b in engine.module.named_buffers()}, "loss": []}
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(case.get("steps", 6)):
        x = torch.randn(2, SEQ, DIM, generator=g).to(torch.bfloat16)
        y = torch.randn(2, SEQ, 4, generator=g)
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        record["loss"].append(loss.item())
    os.makedirs(os.path.join(out, case["name"]), exist_ok=True)
    with open(os.path.join(out, case["name"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    # 120 s, not gloo's default: a rank that never joins a collective (DeepSpeed's own stage-3 trace check
    # once hung so in CI) fails the run in two minutes instead of costing CI ten
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    rank = deepspeed.comm.get_rank()
    for case in json.loads(args.cases):
        run_case(case, args.out, rank)
    deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
