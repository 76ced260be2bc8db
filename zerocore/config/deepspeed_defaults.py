"""DeepSpeed 0.19's default for every key of the schema, beside zerocore's (rendered into
docs/config.md; a test reads the installed DeepSpeed and checks these values).

``ONLY_ZEROCORE``: a key DeepSpeed does not have. ``DIFFERS``: where zerocore's default is not
DeepSpeed's, and why that does not change what a DeepSpeed config trains.
"""
from __future__ import annotations

from .schema import DEFAULT_LEAF_CLASSES

ONLY_ZEROCORE = object()

DEEPSPEED_DEFAULTS: dict[str, object] = {
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": None,
    "gradient_clipping": 1.0, "dataloader_drop_last": False, "managed_gradient_accumulation": True,
    "optimizer.type": None, "optimizer.params.lr": 1e-3, "optimizer.params.betas": [0.9, 0.999],
    "scheduler.type": None, "scheduler.params": {}, "zero_allow_untested_optimizer": False,
    "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0, "optimizer.params.adam_w_mode": True,
    "fp16.enabled": False, "fp16.loss_scale": 0.0, "fp16.initial_scale_power": 16, "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2, "fp16.consecutive_hysteresis": False, "fp16.min_loss_scale": 1.0,
    "bf16.enabled": False, "bf16.check_grad_overflow": True,
    "data_types.buffer_dtype": None, "data_types.grad_accum_dtype": None, "data_types.keep_in_fp32_modules": "auto",
    "data_types.master_init": ONLY_ZEROCORE,
    "zero_optimization.stage": 0, "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True, "zero_optimization.overlap_comm": None,
    "zero_optimization.reduce_dtype": ONLY_ZEROCORE,
    "zero_optimization.reduce_bucket_size": 500_000_000, "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.allgather_partitions": True, "zero_optimization.round_robin_gradients": False,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_unit_classes": ONLY_ZEROCORE, "zero_optimization.stage3_unit_min_params": ONLY_ZEROCORE,
    "zero_optimization.stage3_persistent_param_names": ONLY_ZEROCORE,
    "zero_optimization.stage3_gather_for_generation": ONLY_ZEROCORE,
    "zero_optimization.stage3_check_divergence": ONLY_ZEROCORE,
    "zero_optimization.stage3_divergence_timeout": ONLY_ZEROCORE, "zero_optimization.enable_sanity_checks": False,
    "zero_optimization.comm_timeout": ONLY_ZEROCORE, "zero_optimization.agreement_timeout": ONLY_ZEROCORE,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.offload_optimizer.device": "none", "zero_optimization.offload_optimizer.nvme_path": None,
    "zero_optimization.offload_optimizer.pin_memory": True, "zero_optimization.offload_optimizer.buffer_count": 4,
    "zero_optimization.offload_optimizer.ratio": 1.0, "zero_optimization.offload_optimizer.fast_init": False,
    "zero_optimization.offload_optimizer.speculative_step": ONLY_ZEROCORE,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_param.device": "none", "zero_optimization.offload_param.nvme_path": None,
    "zero_optimization.offload_param.pin_memory": True, "zero_optimization.offload_param.buffer_count": 5,
    "zero_optimization.offload_param.buffer_size": 100_000_000,
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,
    "zero_optimization.leaf_module.classes": list(DEFAULT_LEAF_CLASSES), "zero_optimization.leaf_module.names": [],
    "zero_optimization.leaf_module.name_suffixes": [],
    "aio.block_size": 1_048_576, "aio.queue_depth": 8, "aio.intra_op_parallelism": 1, "aio.single_submit": False,
    "aio.overlap_events": True, "aio.backend": ONLY_ZEROCORE, "checkpoint.tag_validation": "WARN",
    "torch_autocast.enabled": False, "torch_autocast.dtype": None, "torch_autocast.lower_precision_safe_modules": None,
}

DIFFERS: dict[str, str] = {
    "optimizer.type": "DeepSpeed builds no optimizer without an optimizer section (its engine then cannot step); "
                      "zerocore steps AdamW with optimizer.params. A config that names its optimizer trains the "
                      "same.",
    "zero_optimization.stage3_max_reuse_distance": "memory only: DeepSpeed's 1e9 keeps every unit of a model under "
                                                   "a billion parameters gathered from its forward to its backward "
                                                   "(stage 2's parameter memory); zerocore frees after each use. "
                                                   "The values computed are the same.",
}
