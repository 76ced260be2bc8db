"""DeepSpeed's config object (``deepspeed.runtime.config.DeepSpeedConfig``) over a list of configs, under the library
``ZC_FACE`` picks: for each config the attributes a script reads (the batch sizes as resolved, the ZeRO stage,
the precision sections, the optimizer and scheduler, the defaults), or the error's type. One gloo rank; the
data-parallel world of the batch-size cases comes from an ``mpu`` (DeepSpeed's way to give it)."""
import importlib

import torch

from face_script import library, start

deepspeed = library()
DeepSpeedConfig = importlib.import_module(deepspeed.__name__ + ".runtime.config").DeepSpeedConfig  # (the chosen one's)

ATTRS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "world_size",
         "global_rank", "zero_enabled", "zero_optimization_stage", "gradient_clipping", "steps_per_print",
         "managed_gradient_accumulation", "optimizer_name", "optimizer_params", "scheduler_name", "scheduler_params",
         "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "dataloader_drop_last",
         "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "disable_python_gc",
         "checkpoint_tag_validation_enabled",
         "checkpoint_tag_validation_fail", "grad_accum_dtype", "wall_clock_breakdown", "memory_breakdown",
         "torch_autocast_enabled", "torch_autocast_dtype", "torch_autocast_lower_precision_safe_modules")
PRECISION = {"float16_config": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                "consecutive_hysteresis", "min_loss_scale", "auto_cast"),
             "bfloat16_config": ("enabled", "immediate_grad_update", "check_grad_overflow")}
ZERO = ("stage", "overlap_comm", "reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients",
        "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
        "gather_16bit_weights_on_model_save", "sub_group_size")


class World:  # an mpu giving the data-parallel world
    def __init__(self, n):
        self.n = n

    def get_data_parallel_world_size(self):
        return self.n


def case(cfg: dict, world: int):
    try:
        c = DeepSpeedConfig(cfg, mpu=World(world) if world > 1 else None)
    except Exception as e:  # noqa: BLE001 - the error's kind is what is compared
        return {"error": "AssertionError" if isinstance(e, AssertionError) else "other"}
    out = {a: getattr(c, a) for a in ATTRS}
    for section, names in PRECISION.items():
        out.update({f"{section}.{n}": getattr(getattr(c, section), n) for n in names})
    out.update({f"zero_config.{n}": getattr(c.zero_config, n) for n in ZERO})
    out["zero_config.offload_optimizer"] = c.zero_config.offload_optimizer is not None
    return out


CASES = [
    ({"train_batch_size": 64}, 1),
    ({"train_batch_size": 32}, 2),
    ({"train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, 2),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 2),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 2),
    ({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17}, 2),  # DeepSpeed's assertion
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 2),
    ({"gradient_accumulation_steps": 4}, 1),
    ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                                    "hysteresis": 3, "min_loss_scale": 4}}, 1),
    ({"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True}}, 1),
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True, "check_grad_overflow": False},
      "fp16": {"enabled": True}}, 1),  # both: DeepSpeed's assertion
    ({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "steps_per_print": 7,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "max_grad_norm": 1.0}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
      "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7,
                            "offload_optimizer": {"device": "cpu"}}}, 1),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                                                                 "stage3_param_persistence_threshold": 10,
                                                                 "stage3_gather_16bit_weights_on_model_save": True},
      "zero_allow_untested_optimizer": True, "dataloader_drop_last": True, "checkpoint": {"tag_validation": "FAIL"},
      "data_types": {"grad_accum_dtype": "fp32"}}, 1),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
      "torch_autocast": {"enabled": True, "dtype": "bfloat16",
                         "lower_precision_safe_modules": ["torch.nn.Linear"]}}, 1),
    ({"train_micro_batch_size_per_gpu": 2, "torch_autocast": {"enabled": True}}, 1),
    ({"train_batch_size": 4, "quantize_training": {"enabled": True}}, 1),  # removed in 0.19.8: refused
    ({"train_batch_size": 4, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}, 1),
]


def main():
    out = start(deepspeed)
    torch.save([case(cfg, world) for cfg, world in CASES], out)


if __name__ == "__main__":
    main()
