"""``deepspeed.runtime.config.DeepSpeedConfig``: a whole DeepSpeed config read into DeepSpeed's config object, the
way scripts use it to learn what a config means before (or without) an engine: the three batch sizes resolved
against the data-parallel world (any two give the third; one alone with accumulation 1), the ZeRO section
(``zero_config``, ``zero_optimization_stage``), the precision sections, the optimizer and scheduler names and
parameters, with DeepSpeed 0.19's defaults and its checks (AssertionErrors with its messages).

The features DeepSpeed 0.19.8 removed (``quantize_training``, ``elasticity``, ``zero_optimization.mics_shard_size``,
...) are refused as it refuses them (a ``DeepSpeedConfigError``, here zerocore's ``ConfigError``, naming the key);
other keys zerocore does not train with stay in ``_param_dict`` (``zerocore.deepspeed.initialize`` is where those
are refused). The sections zerocore has (``zero_optimization``, ``fp16``, ``bf16``) are validated by its schema,
so a bad value there is a ``ConfigError`` naming the key. A file is read as JSON, else HJSON, a key given twice
refused; a string that is no file is read as base64 of such a text (DeepSpeed's launcher passes configs that
way)."""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os

from ...config import ConfigError
from ...config.parse import read_config_file
from ...config.schema import AUTOCAST_DTYPES, resolve_batch_sizes
from ...runtime.buffer_dtypes import DTYPES
from ..utils.logging import logger
from .precision_config import get_bfloat16_config, get_float16_config
from .zero.config import DeepSpeedZeroConfig

_OPTIMIZER_NAMES = ("adagrad", "adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam",
                    "muadamw", "musgd", "lion", "muon")  # DeepSpeed's DEEPSPEED_OPTIMIZERS: their names lower-cased
# DeepSpeed 0.19's plain keys this object carries: key -> (attribute, default) (deepspeed/runtime/constants.py)
_SCALARS = {"managed_gradient_accumulation": ("managed_gradient_accumulation", True),
            "steps_per_print": ("steps_per_print", None), "dump_state": ("dump_state", False),
            "disable_allgather": ("disable_allgather", False),
            "communication_data_type": ("communication_data_type", None),
            "prescale_gradients": ("prescale_gradients", False),
            "gradient_predivide_factor": ("gradient_predivide_factor", 1.0),
            "gradient_clipping": ("gradient_clipping", 1.0), "disable_python_gc": ("disable_python_gc", False),
            "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer", False),
            "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer", True),
            "wall_clock_breakdown": ("wall_clock_breakdown", False), "memory_breakdown": ("memory_breakdown", False),
            "dataloader_drop_last": ("dataloader_drop_last", False)}
# what DeepSpeed 0.19.8 removed: a config naming one is refused rather than trained without it
_REMOVED = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
            "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop")
_REMOVED_ZERO = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")


def _read(config) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        return read_config_file(os.fspath(config))
    if isinstance(config, str):
        try:
            text = base64.urlsafe_b64decode(config).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            text = None
        if text is not None:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                try:
                    import hjson
                    data = hjson.loads(text)
                except Exception:  # noqa: BLE001 - not HJSON either (or no hjson): the error below
                    data = None
            if isinstance(data, dict):
                return data
    raise ValueError(f"Expected a string path to an existing deepspeed config, or a dictionary or a valid base64. "
                     f"Received: {config}")


def _rank_and_world(config: dict, mpu, mesh_device) -> tuple[int, int]:
    """(this rank, the data-parallel world) as DeepSpeed counts them; (0, 1) before torch.distributed starts."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank = dist.get_rank()
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return rank, mpu.get_data_parallel_world_size()
        return rank, dist.get_world_size() / mpu.get_sequence_parallel_world_size()  # (Ulysses: DeepSpeed's float)
    if mesh_device is not None:
        return rank, dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    if "sequence_parallel_size" in config:
        return rank, dist.get_world_size() / config["sequence_parallel_size"]
    return rank, dist.get_world_size()


class DeepSpeedConfig:
    def __init__(self, config, mpu=None, mesh_device=None):
        self._param_dict = _read(config)
        removed = [k for k in _REMOVED if k in self._param_dict]
        zero = self._param_dict.get("zero_optimization")
        removed += [f"zero_optimization.{k}" for k in _REMOVED_ZERO if isinstance(zero, dict) and k in zero]
        if removed:
            raise ConfigError(f"{removed[0]}: DeepSpeed 0.19.8 removed this feature and refuses the key (training "
                              "would silently run without it); remove it from the config")
        self.global_rank, self.world_size = _rank_and_world(self._param_dict, mpu, mesh_device)
        self._initialize_params(copy.copy(self._param_dict))  # (a copy: the user's dict is left as given)
        self._configure_train_batch_size()
        self._do_sanity_check()

    def _initialize_params(self, param_dict: dict) -> None:
        self.train_batch_size = param_dict.get("train_batch_size")
        self.train_micro_batch_size_per_gpu = param_dict.get("train_micro_batch_size_per_gpu")
        self.gradient_accumulation_steps = param_dict.get("gradient_accumulation_steps")
        for key, (attr, default) in _SCALARS.items():
            setattr(self, attr, param_dict.get(key, default))

        zero = param_dict.get("zero_optimization", {})
        if isinstance(zero, bool):  # DeepSpeed's oldest spelling: true means stage 1
            zero = {"stage": int(zero)}
        self.zero_config = DeepSpeedZeroConfig(**zero)
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0

        self.float16_config = get_float16_config(param_dict)
        self.bfloat16_config = get_bfloat16_config(param_dict)
        assert not (self.float16_config.enabled and self.bfloat16_config.enabled), \
            "bfloat16 and fp16 modes cannot be simultaneously enabled"

        optimizer = param_dict.get("optimizer") or {}
        self.optimizer_name = optimizer.get("type")
        if isinstance(self.optimizer_name, str) and self.optimizer_name.lower() in _OPTIMIZER_NAMES:
            self.optimizer_name = self.optimizer_name.lower()
        self.optimizer_params = optimizer.get("params") if self.optimizer_name is not None else None
        self.optimizer_legacy_fusion = optimizer.get("legacy_fusion", False)
        scheduler = param_dict.get("scheduler") or {}
        self.scheduler_name = scheduler.get("type")
        self.scheduler_params = scheduler.get("params") if self.scheduler_name is not None else None

        checkpoint = param_dict.get("checkpoint") or {}
        mode = str(checkpoint.get("tag_validation", "WARN")).upper()
        self.checkpoint_tag_validation_enabled = mode != "IGNORE"
        self.checkpoint_tag_validation_fail = mode == "FAIL"
        self.load_universal_checkpoint = checkpoint.get("load_universal", False)
        self.use_node_local_storage = checkpoint.get("use_node_local_storage", False)
        types = param_dict.get("data_types") or {}
        self.grad_accum_dtype = types.get("grad_accum_dtype")
        self.param_dtype = types.get("param_dtype")
        self.buffer_dtype = types.get("buffer_dtype")
        autocast = param_dict.get("torch_autocast") or {}  # DeepSpeed's attributes: the dtype as given, else None
        self.torch_autocast_enabled = autocast.get("enabled", False)
        dtype = autocast.get("dtype")
        self.torch_autocast_dtype = None if dtype not in AUTOCAST_DTYPES else DTYPES[AUTOCAST_DTYPES[dtype]]
        self.torch_autocast_lower_precision_safe_modules = autocast.get("lower_precision_safe_modules")

    # -- the batch sizes, as DeepSpeed resolves and checks them --------------------------------------
    def _configure_train_batch_size(self) -> None:
        """The three batch sizes (as given, or as a caller set them on this object) resolved against the
        data-parallel world by the engine's own rule (``config.schema.resolve_batch_sizes``: any two give the third,
        one alone with accumulation 1), a mismatch refused with DeepSpeed's AssertionError."""
        tb, mb, ga = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        assert tb is not None or mb is not None, \
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
        try:
            ga, mb, tb = resolve_batch_sizes(tb, mb, ga, self.world_size)
        except ConfigError as e:
            raise AssertionError(f"Check batch related parameters: {e}") from None
        assert tb > 0, f"Train batch size: {tb} has to be greater than 0"
        assert mb > 0, f"Micro batch size per gpu: {mb} has to be greater than 0"
        assert ga > 0, f"Gradient accumulation steps: {ga} has to be greater than 0"
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tb, mb, ga

    # -- DeepSpeed's other checks --------------------------------------------------------------------
    def _do_sanity_check(self) -> None:
        self._do_error_check()
        self._do_warning_check()

    def _do_error_check(self) -> None:
        assert self.train_micro_batch_size_per_gpu, "DeepSpeedConfig: train_micro_batch_size_per_gpu is not defined"
        assert self.gradient_accumulation_steps, "DeepSpeedConfig: gradient_accumulation_steps is not defined"
        if self.zero_enabled:
            assert self.zero_optimization_stage <= 3, "DeepSpeedConfig: Maximum supported ZeRO stage is 3"
        for flag, what in ((self.float16_config.fp16_master_weights_and_grads, "Fp16_master_weights_and_grads"),
                           (self.bfloat16_config.bf16_master_weights_and_grads, "Bf16_master_weights_and_grads")):
            if flag:
                assert self.zero_enabled and self.zero_optimization_stage in (1, 2, 3), \
                    f"{what} is only supported with ZeRO Stage 1, 2, or 3."
        if self.bfloat16_config.bf16_optimizer_states:
            assert self.zero_enabled and self.zero_optimization_stage in (1, 2, 3), \
                "bf16_optimizer_states is only supported with ZeRO Stage 1, 2, or 3."
            assert self.bfloat16_config.bf16_master_weights_and_grads, \
                "bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled."

    def _do_warning_check(self) -> None:
        vocabulary = self._param_dict.get("vocabulary_size")
        if vocabulary and vocabulary % 8:
            logger.warning(f"DeepSpeedConfig: vocabulary size {vocabulary} is not aligned to 8, may import tensor "
                           "core utilization.")
        params = self.optimizer_params
        if params is not None and params.get("max_grad_norm", 0) > 0 and self.global_rank == 0:
            logger.warning(f"DeepSpeedConfig: max_grad_norm ({params['max_grad_norm']}) is not supported as an "
                           "optimizer parameter, please switch to using the deepspeed parameter 'gradient_clipping'")

    # -- printing ------------------------------------------------------------------------------------
    def print_user_config(self) -> None:
        logger.info("  json = " + json.dumps(self._param_dict, sort_keys=True, indent=4, separators=(",", ":"),
                                             default=str))

    def print(self, name: str) -> None:
        logger.info(f"{name}:")
        for key in sorted(vars(self)):
            if key != "_param_dict":
                logger.info(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        self.print_user_config()
