"""``deepspeed.initialize`` with no optimizer and no ``optimizer`` section (the engine TRL's ``prepare_deepspeed`` and
Transformers' ``deepspeed_init(inference=True)`` build for a model they only run), under torchrun with the real
DeepSpeed or with zerocore.deepspeed (``ZC_FACE`` picks, nothing else differs; face_script.py). Per case (a stage, a dtype, a model
frozen by requires_grad or not): whether initialize refused and with what type, whether it returned an optimizer,
the forward's output under no_grad on this rank's batch, each parameter's numel outside the forward (stage 3:
partitioned), and whether ``engine.step()`` raised. Written to ``<out>/<name>/rank<r>.json``."""
import torch

from face_script import each_case, library

deepspeed = library()


def run(case: dict, rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    if case["frozen"]:
        model.requires_grad_(False)
    bf16 = case["dtype"] == "bf16"
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16},
           "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0}}
    if case["stage"] != 3:
        del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    try:
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=cfg)
    except AssertionError as e:
        return {"refused": "AssertionError", "message": str(e)}
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        y = engine(x.bfloat16() if bf16 else x)
    rec = {"refused": None, "optimizer_returned": optimizer is not None, "scheduler": scheduler is not None,
           "out": y.float().reshape(-1).tolist(), "numel_outside": [p.numel() for p in model.parameters()]}
    try:
        engine.step()
        rec["step_raised"] = False
    except Exception:  # DeepSpeed: an AssertionError at stage 0, an AttributeError at stage 3 (no optimizer to step)
        rec["step_raised"] = True
    return rec


if __name__ == "__main__":
    each_case(deepspeed, run)
