"""One bf16 model (built in fp32, so its values are not bf16 numbers) through ``deepspeed.initialize`` at
ZeRO stages 1-3, with the same seed each time: saves each parameter's fp32 master right after initialize
(``safe_get_full_fp32_param``), and its 16-bit value after one step, to ``--out``. ``ZC_FACE=deepspeed|zerocore``
picks the library, nothing else differs. One process, one rank (gloo)."""
import torch

from face_script import library, start

deepspeed = library()
safe_get_full_fp32_param = deepspeed.utils.safe_get_full_fp32_param  # (the chosen library's)


def run(stage: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = {"master:" + n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out.update({"stepped:" + n: p.detach().clone() for n, p in model.named_parameters()})
    engine.destroy()
    return out


def main():
    out = start(deepspeed)
    torch.save({stage: run(stage) for stage in (1, 2, 3)}, out)


if __name__ == "__main__":
    main()
