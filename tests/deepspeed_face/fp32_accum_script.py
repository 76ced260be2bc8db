"""bf16 training at ZeRO stage 1 with ``data_types.grad_accum_dtype: "fp32"`` (DeepSpeed's BF16 optimizer) through
``deepspeed.initialize``: the accumulated gradient at each window's boundary before its step
(``safe_get_full_grad``), and the fp32 master after it, over two windows of 4 micro-batches. ``ZC_FACE`` picks the
library; one gloo rank."""
import torch

from face_script import library, start

deepspeed = library()
utils = deepspeed.utils


def main():
    out = start(deepspeed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 16))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
           "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    record = {}
    for w in range(2):
        for j in range(4):
            g = torch.Generator().manual_seed(100 + 4 * w + j)
            x, y = torch.randn(4, 16, generator=g).bfloat16(), torch.randn(4, 16, generator=g).bfloat16()
            loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
            engine.backward(loss)
            if j == 3:
                record.update({f"grad{w}:{n}": utils.safe_get_full_grad(p).clone()
                               for n, p in engine.module.named_parameters()})
            engine.step()
        record.update({f"master{w}:{n}": utils.safe_get_full_fp32_param(p).clone()
                       for n, p in engine.module.named_parameters()})
    engine.destroy()
    torch.save(record, out)


if __name__ == "__main__":
    main()
