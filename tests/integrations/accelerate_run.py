"""One Accelerate training loop under torchrun: plain Accelerator (DDP), ZeroAccelerator, or Accelerator with
DeepSpeed itself (its DeepSpeedPlugin given the config ZeroAccelerator gets; DS_ACCELERATOR=cpu).
argv: ddp|zerocore|deepspeed stage out.json [samples] [epochs]. Writes rank 0's losses, lrs, the gradient
norms of the optimizer steps and the final weights. With samples / (8 x ranks) micro-batches per
rank not a multiple of the accumulation steps (2), each epoch ends with a short window."""
import json
import sys

import torch
from torch import nn

from accelerate import Accelerator

from ddp_teardown import end_reference_run  # (this folder: the script's own, first on sys.path)


def main():
    kind, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    samples = int(sys.argv[4]) if len(sys.argv) > 4 else 640
    epochs = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * max(0.1, 1 - s / 40))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 24, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :5] * 3).argmax(-1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    # stage 3 partitions every weight: all of this net's are under the default persistence threshold, kept whole
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    if kind == "zerocore":
        from zerocore.integrations.accelerate import ZeroAccelerator

        acc = ZeroAccelerator(cpu=True, gradient_accumulation_steps=2,
                              zerocore_config={"zero_optimization": zero, "gradient_clipping": 0.5})
    elif kind == "deepspeed":
        from accelerate import DeepSpeedPlugin

        ds = {"zero_optimization": zero, "gradient_clipping": 0.5, "gradient_accumulation_steps": 2,
              "train_micro_batch_size_per_gpu": 8}
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
    else:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    weights = list(model.parameters())
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    partitioned = sum(w.numel() == 0 for w in weights)  # stage 3: the empty stand-ins outside a forward
    losses, lrs, norms = [], [], []
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:  # the norm before clipping, over every rank's gradients
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
            lrs.append(opt.param_groups[0]["lr"])
    sd = acc.get_state_dict(model)
    if acc.is_main_process:
        with open(out, "w") as f:
            json.dump({"losses": losses, "lrs": lrs, "grad_norms": norms, "partitioned": partitioned,
                       "weights": {k: v.reshape(-1).tolist() for k, v in sd.items()}}, f)
    if kind != "zerocore":
        end_reference_run()


if __name__ == "__main__":
    main()
