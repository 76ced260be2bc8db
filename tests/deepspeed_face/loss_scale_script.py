"""fp16's dynamic loss scale step by step, DeepSpeed's and the face's: one model trained in fp16 through
``deepspeed.initialize`` at ZeRO stages 0-3 under several ``fp16`` sections, an Inf put into the input at chosen
steps (the same overflows in both libraries); saves, per stage and case, every step's loss scale (read after the
step), skipped-step count and loss to ``--out``. ``ZC_FACE=deepspeed|zerocore`` picks the library, nothing else
differs. One process, one rank (gloo)."""
import torch

from face_script import library, start

deepspeed = library()

STEPS = 16
OVERFLOW_AT = {0, 1, 6, 7, 8, 13}  # steps whose input holds an Inf (so do their gradients)
# (name, fp16 section): hysteresis 1 and 2, consecutive hysteresis on and off, windows 2 and 3, the defaults' power
CASES = [
    ("window2", {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}),
    ("window3_hysteresis2", {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2}),
    ("window2_consecutive", {"initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 2,
                             "consecutive_hysteresis": True}),
    ("defaults", {}),
]
# (name, fp16 section, engine config): the defaults (no step raises the scale) with clipping that bites, with the
# optimizer on the host, with two micro-steps a boundary, and a fixed scale; ZeRO stages (DeepSpeed's CPU offload
# needs them)
ZERO_CASES = [
    ("defaults_clipped", {}, {"gradient_clipping": 0.05}),
    ("defaults_offload", {}, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    ("defaults_accumulated", {}, {"gradient_accumulation_steps": 2}),  # an Inf in either micro-step skips the boundary
    ("static_128", {"loss_scale": 128}, {}),  # a fixed scale: overflows skip, the scale stays
]


def scale_of(engine) -> float:
    """The loss scale the next backward uses, by the name every DeepSpeed fp16 optimizer has (``loss_scale``)."""
    return float(engine.optimizer.loss_scale)


def run(stage: int, fp16: dict, extra: dict | None = None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 0, **fp16},
           "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    for key, value in (extra or {}).items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(1)
    rec = {"initial": scale_of(engine), "scale": [], "skipped": [], "loss": []}
    for step in range(STEPS):
        x = torch.randn(2, 8, generator=gen)
        if step in OVERFLOW_AT:
            x[0, 0] = float("inf")
        loss = engine(x.half()).float().square().mean()
        engine.backward(loss)
        engine.step()
        rec["scale"].append(scale_of(engine))
        rec["skipped"].append(int(engine.skipped_steps))
        rec["loss"].append(float(loss.detach()))
    engine.destroy()
    return rec


def main():
    out = start(deepspeed)
    runs = {(stage, name): run(stage, fp16) for stage in (0, 1, 2, 3) for name, fp16 in CASES}
    runs.update({(stage, name): run(stage, fp16, extra) for stage in (1, 2, 3) for name, fp16, extra in ZERO_CASES})
    torch.save(runs, out)


if __name__ == "__main__":
    main()
