"""Where ``zerocore.deepspeed.initialize`` follows DeepSpeed rather than ``zerocore.initialize``.

zerocore's own entry point refuses some things DeepSpeed ignores or allows, and allows some things
DeepSpeed refuses (docs/deepspeed_unit_tests.md, "What zerocore does differently"). A script written
for DeepSpeed gets DeepSpeed's behaviour for these; the engine it gets carries the choice as
``engine.deepspeed_semantics`` (a :class:`DeepSpeedSemantics`; None for engines of
``zerocore.initialize``):

- ``offload_param`` (or ``cpu_offload_param``) below stage 3: ignored with a warning naming the key
  (zerocore: refused by the config);
- ``ignore_unused_parameters: false``: at stages 1-2 with optimizer offload, a trainable parameter
  that got no gradient in an accumulation window is an AssertionError at that window's ``step()``;
  elsewhere accepted and without effect (zerocore: refused by the config);
- ``zero_force_ds_cpu_optimizer`` (default true) with optimizer offload and a client optimizer
  other than ``DeepSpeedCPUAdam``: ``ZeRORuntimeException`` naming the key (zerocore: accepted);
- ``zero_allow_untested_optimizer`` (default false) at ZeRO stages 1-3 with a client optimizer whose type
  is not one DeepSpeed lists as tested (torch's Adam, AdamW, Adagrad; ``FusedAdam``, ``DeepSpeedCPUAdam``):
  ``AssertionError`` naming the key (zerocore: accepted, whatever the key says);
- a parameter trainable at initialize whose ``requires_grad`` becomes False: a zero gradient and one
  warning naming it (zerocore: refused at the next step);
- ``load_checkpoint`` with optimizer states of a ZeRO (or bf16) engine saved at another
  data-parallel world size: ``ZeRORuntimeException``, unless ``checkpoint.load_universal`` is true
  (zerocore: reshards them);
- a boundary whose gradient norm is Inf/NaN: skipped (``skipped_steps`` + 1, the lr schedule held) where
  DeepSpeed 0.19.8 skips it: fp16; ZeRO stage 3 whatever the dtype and ``bf16.check_grad_overflow``;
  stages 1/2 unless bf16 with ``check_grad_overflow: false`` (DeepSpeedZeroOptimizer.step's
  ``self.dtype != torch.bfloat16 or self.check_grad_overflow``), so fp32 too; stage 0 as zerocore (fp16,
  bf16 with the check) (zerocore: fp16 and bf16 with the check only; fp32 applies it, as torch.optim);
  compared side by side in tests/deepspeed_face/test_against_deepspeed.py;
- ``managed_gradient_accumulation: false`` with ``overlap_comm: true`` at stages 0/1: AssertionError (zerocore:
  accepted, stages 0/1 reduce in step() then and there is nothing to overlap);
- ``data_types.master_init`` unset: the fp32 master of bf16/fp16 training starts from the values rounded to 16
  bits, as DeepSpeed copies it from the converted model (zerocore: from the values given, as FSDP2 keeps them);
  compared bit for bit by DeepSpeed's test_zero_user_backward.py against DDP on a bf16 model;
- ``data_types.buffer_dtype`` null (the default): floating buffers keep their dtype under bf16/fp16, as
  DeepSpeed 0.19.8 casts only the parameters (zerocore: a Transformers model's buffers kept, the others cast to
  the training dtype, since a custom model's fp32 buffer makes its 16-bit activations fp32; ``"keep"`` asks for
  DeepSpeed's rule); in both a normalization layer's running statistics follow its 16-bit weights (its kernels
  refuse fp32 statistics beside them: DeepSpeed's own engine fails there);
  compared side by side in tests/deepspeed_face/test_buffers_against_deepspeed.py.
"""
from __future__ import annotations

import copy
import os
import warnings

import torch

from .._weak import remove_when_freed, weak_call
from ..config.schema import KEEP
from .runtime.zero.utils import ZeRORuntimeException

_OFFLOADING = ("cpu", "nvme")


def _stage(z: dict) -> int:
    stage = z.get("stage", 0)
    return stage if isinstance(stage, int) else 0


def _offload_device(z: dict, section: str, legacy: str) -> str:
    sec = z.get(section)
    if isinstance(sec, dict) and sec.get("device") is not None:
        return str(sec["device"])
    return "cpu" if z.get(legacy) is True else "none"


def prepare_config(raw: dict | None, warn: bool = True):
    """The config to hand zerocore's loader (None: ``raw`` itself as given; else a copy without the
    keys DeepSpeed ignores here) and the :class:`DeepSpeedSemantics` noted from it. ``raw`` None: a
    ZeroConfig object, taken as it is. ``warn``: warn of an ignored key (``initialize`` does;
    ``zero.Init`` reading the same config does not)."""
    sem = DeepSpeedSemantics()
    if raw is None:
        return None, sem
    z = raw.get("zero_optimization")
    changed = None
    # the keys the face honours itself: not handed on (zerocore's loader would warn they change nothing)
    sem.force_ds_cpu_optimizer = raw.get("zero_force_ds_cpu_optimizer", True) is not False
    if "zero_force_ds_cpu_optimizer" in raw:
        changed = copy.deepcopy(raw)
        del changed["zero_force_ds_cpu_optimizer"]
    ckpt = raw.get("checkpoint")
    sem.load_universal = isinstance(ckpt, dict) and ckpt.get("load_universal") is True
    if isinstance(ckpt, dict) and "load_universal" in ckpt:
        changed = changed if changed is not None else copy.deepcopy(raw)
        del changed["checkpoint"]["load_universal"]
    dt = raw.get("data_types")
    if dt is None or isinstance(dt, dict) and (dt.get("buffer_dtype") is None or "master_init" not in dt):
        # DeepSpeed's null buffer_dtype keeps every buffer's dtype (zerocore.initialize's casts them), and its
        # fp32 master is copied from the model converted to 16 bits (zerocore.initialize's, from the given values)
        changed = changed if changed is not None else copy.deepcopy(raw)
        dt = dict(dt or {})
        if dt.get("buffer_dtype") is None:
            dt["buffer_dtype"] = KEEP
        dt.setdefault("master_init", "rounded")
        changed["data_types"] = dt
    if not isinstance(z, dict):
        return changed, sem
    stage = _stage(z)
    if stage < 3 and _offload_device(z, "offload_param", "cpu_offload_param") != "none":
        keys = [k for k in ("offload_param", "cpu_offload_param") if k in z]
        if warn:
            warnings.warn(f"zerocore.deepspeed: zero_optimization.{' and '.join(keys)} ignored: parameter offload "
                          f"needs stage 3 (this config has stage {stage}), and DeepSpeed ignores it below stage 3 "
                          "(zerocore.initialize refuses it)", UserWarning, stacklevel=4)
        changed = changed if changed is not None else copy.deepcopy(raw)
        for k in keys:
            del changed["zero_optimization"][k]
    if z.get("ignore_unused_parameters") is False:
        sem.ignore_unused_parameters = False
        sem.assert_unused = stage in (1, 2) and _offload_device(z, "offload_optimizer", "cpu_offload") in _OFFLOADING
        changed = changed if changed is not None else copy.deepcopy(raw)
        del changed["zero_optimization"]["ignore_unused_parameters"]
    return changed, sem


def loadable(config):
    """``config`` as ``zero.Init`` hands it to zerocore's loader: without the keys DeepSpeed ignores
    (no warning: ``initialize`` warns of them)."""
    from .launch import _raw_dict

    changed, _ = prepare_config(_raw_dict(config), warn=False)
    return changed if changed is not None else config


class DeepSpeedSemantics:
    """The DeepSpeed behaviours an engine made by ``zerocore.deepspeed.initialize`` follows (see the
    module docstring); ``engine.deepspeed_semantics``."""

    force_ds_cpu_optimizer = True  # zero_force_ds_cpu_optimizer
    load_universal = False  # checkpoint.load_universal: optimizer states load at another world size
    ignore_unused_parameters = True  # zero_optimization.ignore_unused_parameters
    assert_unused = False  # ... false, at stages 1-2 with optimizer offload: DeepSpeed's assertion applies

    def check_client_optimizer(self, optimizer, cfg) -> None:
        """DeepSpeed's ``zero_allow_untested_optimizer`` and ``zero_force_ds_cpu_optimizer`` rules, before the
        engine is built."""
        from .ops.adam import DeepSpeedCPUAdam, FusedAdam

        tested = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam, DeepSpeedCPUAdam)
        if (optimizer is not None and cfg.zero_optimization.stage > 0 and not cfg.zero_allow_untested_optimizer
                and type(optimizer) not in tested):  # DeepSpeed compares the exact type, not isinstance
            raise AssertionError(
                f"zerocore.deepspeed: You are using an untested ZeRO Optimizer ({type(optimizer).__name__}). Please add "
                "<\"zero_allow_untested_optimizer\": true> in the configuration file to use it (DeepSpeed's rule at "
                f"ZeRO stage {cfg.zero_optimization.stage}; zerocore steps any torch.optim.Optimizer on its shards)")

        if (optimizer is None or not self.force_ds_cpu_optimizer or isinstance(optimizer, DeepSpeedCPUAdam)
                or cfg.zero_optimization.offload_optimizer.device not in _OFFLOADING):
            return
        raise ZeRORuntimeException(
            f"zerocore.deepspeed: ZeRO-Offload with a client optimizer ({type(optimizer).__name__}); DeepSpeed "
            "refuses it while zero_force_ds_cpu_optimizer is true (its default), as it would step slowly on the host. "
            "Use deepspeed.ops.adam.DeepSpeedCPUAdam, an optimizer section in the config, or set "
            "\"zero_force_ds_cpu_optimizer\": false (zerocore steps a torch Adam on the host with its own kernel)")

    def check_config(self, cfg) -> None:
        """DeepSpeed's assertion on a config zerocore accepts: with managed_gradient_accumulation false, stages 0/1
        reduce in step(), after every backward, so DeepSpeed refuses overlap_comm there (zerocore: nothing to
        overlap, accepted)."""
        z = cfg.zero_optimization
        if not cfg.managed_gradient_accumulation and z.stage < 2 and z.overlap_comm:
            raise AssertionError("zerocore.deepspeed: managed_gradient_accumulation=False supports ZeRO overlap_comm "
                                 f"only with ZeRO stage 2 or 3 (this config has stage {z.stage}): DeepSpeed's rule; "
                                 "set overlap_comm false or leave it unset")

    def attach(self, engine) -> None:
        """Marks the engine and sets its DeepSpeed behaviours."""
        engine.deepspeed_semantics = self
        engine._requires_grad.trainable_off_gets_zero_grad = True
        engine.skip_on_overflow(skips_nonfinite(engine.config))
        if self.assert_unused:
            engine._requires_grad = _UnusedParameterAssert(engine._requires_grad, engine)

    def universal_tag(self, load_dir, tag):
        """The tag to load: with ``checkpoint.load_universal`` and none given, the one ``latest_universal`` names
        (DeepSpeed's rule: a ValueError when that file is missing); else ``tag``."""
        if not self.load_universal or tag is not None:
            return tag
        path = os.path.join(os.fspath(load_dir), "latest_universal")
        if not os.path.isfile(path):
            raise ValueError(f"Invalid for universal checkpoint: {path} does not exist (load_universal reads the tag "
                             "from it: write the universal folder's name there, or pass tag=)")
        with open(path, encoding="utf-8") as f:
            return f.read().strip()

    def before_load(self, engine, load_dir, tag, load_optimizer_states: bool, load_module_only: bool) -> None:
        """DeepSpeed's refusal of ZeRO optimizer states saved at another data-parallel world size
        (unless it loads a universal checkpoint); nothing when there is no checkpoint to read (the load
        itself says so)."""
        if (not load_optimizer_states or load_module_only or self.load_universal
                or not (engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled())):
            return
        from ..checkpoint.layout import read_manifest, resolve

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = resolve(os.fspath(load_dir), tag)
            saved = read_manifest(path)["world_size"] if path is not None else None
        except Exception:  # the load names what is wrong with the checkpoint
            return
        world = engine.dp_world_size
        if saved is not None and saved != world:
            raise ZeRORuntimeException(
                f"The checkpoint being loaded used a DP world size of {saved} but the current world size is {world}. "
                "Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently "
                "supported (DeepSpeed's rule, kept by zerocore.deepspeed; zerocore.initialize's engines reshard the "
                "optimizer state; load_optimizer_states=False loads the weights, and \"checkpoint\": "
                "{\"load_universal\": true} loads the optimizer state at the new world size)")


def skips_nonfinite(cfg) -> bool:
    """Whether DeepSpeed 0.19.8 skips a boundary whose gradient norm is Inf/NaN (see the module docstring)."""
    stage = cfg.zero_optimization.stage
    if cfg.fp16.enabled or stage == 3:
        return True
    checked = cfg.bf16.check_grad_overflow
    if stage in (1, 2):
        return not cfg.bf16.enabled or checked
    return cfg.bf16.enabled and checked


class _UnusedParameterAssert:
    """``ignore_unused_parameters: false`` at stages 1-2 with optimizer offload: DeepSpeed asserts at
    the step ending a window when a trainable parameter got no gradient in it. Wraps the engine's
    requires-grad check (run at each ``step()``, before anything changes); a gradient is seen
    through each trainable parameter's post-accumulate-grad hook."""

    def __init__(self, inner, engine):
        self.inner = inner
        # the engine holds this check: both ways back to it are weak, or the engine would sit in a cycle (and,
        # through the hooks on the model's parameters, live as long as the model): zerocore/_weak.py
        self._boundary = weak_call(engine.is_gradient_accumulation_boundary, quiet=True, default=False)
        self._seen: set[int] = set()
        self._params = [(inner.names[id(p)], p) for p in inner.trainable]
        saw = weak_call(self._saw, quiet=True)
        self._handles = [p.register_post_accumulate_grad_hook(saw) for _, p in self._params]
        remove_when_freed(engine, self._handles)

    def _saw(self, p: torch.Tensor) -> None:
        self._seen.add(id(p))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "_boundary", "_seen", "_params", "_handles"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def check(self) -> None:
        self.inner.check()
        if not self._boundary():
            return
        missing = [n for n, p in self._params if p.requires_grad and id(p) not in self._seen]
        self._seen.clear()
        assert not missing, (
            f"zerocore.deepspeed: parameter(s) {', '.join(repr(n) for n in missing)} got no gradient in this "
            "accumulation window. This assert indicates that your module has parameters that were not used in "
            "producing loss. You can avoid this assert by (1) enable ignore_unused_parameters option in "
            "zero_optimization config; (2) making sure all trainable parameters and `forward` function outputs "
            "participate in calculating loss (DeepSpeed's check at stages 1-2 with optimizer offload)")
