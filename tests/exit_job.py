"""A short training job for tests/comm/test_clean_exit.py, launched by torchrun: trains a few steps
with the process group left to zerocore (the script never initializes it), prints, and ends,
with or without engine.destroy(). Usage: exit_job.py STAGE OFFLOAD(none|cpu|nvme) DESTROY(0|1)
[SWAP_DIR]; with DESTROY 2 it destroys, builds a second engine on the same model and trains again;
with DESTROY 3 rank 0 leaves a collective queued that rank 1, busy elsewhere, never joins and dies of an
exception."""
import os
import sys

import torch

import zerocore

stage, offload, destroy = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
z = {"stage": stage}
if offload != "none":
    z["offload_optimizer"] = {"device": offload}
    if offload == "nvme":
        path = os.path.join(sys.argv[4], f"rank{os.environ['RANK']}")
        os.makedirs(path, exist_ok=True)
        z["offload_optimizer"]["nvme_path"] = path
cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": z}
for round_ in range(2 if destroy == 2 else 1):
    engine = zerocore.initialize(model, cfg)
    for _ in range(5):
        loss = engine(torch.randn(8, 64)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print(f"rank {engine.rank} round {round_} loss {float(loss):.4f}", flush=True)
    if destroy == 3 and engine.rank == 0:
        torch.distributed.all_reduce(torch.ones(1), async_op=True)
        raise RuntimeError("rank 0 fails after training")
    if destroy == 3:  # rank 1 is busy elsewhere (torchrun stops it once rank 0 has failed)
        import time
        time.sleep(150)
    if destroy in (1, 2):
        engine.destroy()
