"""The one config schema. Key names, nesting and defaults follow DeepSpeed's ``ds_config.json``
(the file users already have); every section validates itself on construction, so a
``ZeroConfig`` built in Python is checked exactly like one read from JSON.

Read with :func:`zerocore.config.load_config` (dict, JSON path, or ZeroConfig); other spellings
(DeepSpeed's aliases and deprecated keys, ColossalAI's ``zero=dict(...)`` form) are written in
these names by ``compat/`` first. Every check that involves more than one key is a section's
``check`` (the section that holds all the keys involved), so it runs at construction too.
"""
from __future__ import annotations

import dataclasses

from .aio import BACKENDS as AIO_BACKENDS
from .options import ConfigError, coerce, is_section, option, section, spec_of

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: above this a wait is a hang, and timedelta/gloo overflow
MAX_ACCUMULATION = 1_000_000  # micro-batches per step; above this the optimizer would never step


def _only_stage3(cfg) -> bool:
    return cfg.zero_optimization.stage == 3


def _offloads_optimizer(cfg) -> bool:
    return cfg.zero_optimization.offload_optimizer.device != "none"


def _offloads_params(cfg) -> bool:
    return cfg.zero_optimization.offload_param.device != "none"


def _uses_nvme(cfg) -> bool:
    z = cfg.zero_optimization
    return "nvme" in (z.offload_optimizer.device, z.offload_param.device)


class _Section:
    """Validates every scalar field of a section against its Spec after construction."""

    PATH = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if is_section(f):
                if not isinstance(getattr(self, f.name), f.default_factory):
                    raise ConfigError(f"{self._key(f.name)}: expected a section (a JSON object)")
                continue
            setattr(self, f.name, coerce(self._key(f.name), getattr(self, f.name), spec_of(f)))
        self.check()

    def validate(self) -> None:
        """Checks the section again, and every section in it (a ZeroConfig whose fields were
        assigned after construction is validated like a new one at ``zerocore.initialize``)."""
        self.__post_init__()
        for f in dataclasses.fields(self):
            if is_section(f):
                getattr(self, f.name).validate()

    def _key(self, name: str) -> str:
        return f"{self.PATH}.{name}" if self.PATH else name

    def check(self) -> None:
        """Cross-field checks of this section (overridden where there are any)."""


def _when(pred, text):
    return {"applies_if": pred, "applies": text}


_OPT = _when(_offloads_optimizer, "offload_optimizer.device cpu or nvme")
_PAR = _when(_offloads_params, "offload_param.device cpu or nvme")


@dataclasses.dataclass
class OffloadOptimizerConfig(_Section):
    PATH = "zero_optimization.offload_optimizer"
    device: str = option("none", "Where the optimizer state (fp32 master, m, v) and its step live: cpu = host "
                         "memory, stepped by the SIMD Adam kernel (stages 1-3); nvme = swap files under nvme_path, "
                         "stepped tile by tile (sub_group_size) through buffer_count pinned buffers.",
                         kind=str, choices=("none", "cpu", "nvme"))
    nvme_path: str | None = option(None, "Directory for the swap files when device is nvme (checked at "
                                   "initialize: exists, writable, O_DIRECT, free space); files go to "
                                   "<nvme_path>/zerocore_swap/<run id>/rank<r>/ and are removed at exit.", kind=str,
                                   optional=True, **_OPT)
    pin_memory: bool = option(True, "Use page-locked CPU buffers (faster host/device copies).", kind=bool, **_OPT)
    buffer_count: int = option(4, "Pinned buffers of one tile (sub_group_size elements) each for NVMe "
                               "swapping: the host memory the swapped optimizer state occupies.", kind=int, ge=1,
                               **_OPT)
    ratio: float = option(1.0, "Fraction of each owned optimizer shard stepped on the host (twin-flow); the rest "
                          "stays on the device and is stepped there. Every stage.", kind=float, ge=0.0, le=1.0,
                          **_OPT)
    fast_init: bool = option(False, "NVMe: write the initial optimizer state in batches of buffer_count "
                             "tiles in flight (else one tile at a time).", kind=bool, **_OPT)
    pipeline_read: bool = option(False, "NVMe: read tile k+1 while tile k is stepped.",
                                 kind=bool, **_OPT)
    pipeline_write: bool = option(False, "NVMe: write tile k-1 while tile k is stepped.", kind=bool,
                                  **_OPT)
    speculative_step: bool = option(False, "Device 'cpu', every stage: start the host Adam of each batch of groups "
                                    "(stage 3: each unit) as soon as their gradients have landed, during the "
                                    "backward, out of place, and keep it at step() when the update is the one "
                                    "guessed (the clip coefficient did not bite, no Inf/NaN, the same lr and "
                                    "hyper-parameters), else drop it and step as without: the same bits either "
                                    "way; it pauses while guesses keep failing. Stage 3: a unit's speculation not "
                                    "started by step() is withdrawn (the unit steps in the forward's order). Costs 12 "
                                    "bytes per owned parameter of host memory (a second master, m, v), hence off by "
                                    "default. On an H100 (311M GPT, stage 2) the step took 0.82x the step without it "
                                    "(benchmarks/offload_speculation.py). Not with parameter shards on NVMe. "
                                    "DeepSpeed's super_offload (stage 3, without clipping) is read as this key.", kind=bool, **_OPT)

    def check(self):
        # nvme_path's existence, writability and O_DIRECT support are facts of the machine at
        # zerocore.initialize, not of the config: offload/nvme checks them there
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(f"{self.PATH}.nvme_path: required when device is 'nvme'")
        if self.device == "nvme" and self.ratio < 1.0:
            raise ConfigError(f"{self.PATH}.ratio: {self.ratio} with device 'nvme': the device part of twin-flow is "
                              "not swapped; use ratio 1.0 with nvme, or device 'cpu' for ratio < 1")


@dataclasses.dataclass
class OffloadParamConfig(_Section):
    PATH = "zero_optimization.offload_param"
    device: str = option("none", "Where stage-3 parameter shards live between uses: cpu = host memory, copied to "
                         "the device right before each all-gather; nvme: host memory up to max_in_cpu elements, the "
                         "shards beyond it in swap files under nvme_path, read ahead of their gathers in the recorded "
                         "order and written back after the step.", kind=str,
                         choices=("none", "cpu", "nvme"))
    nvme_path: str | None = option(None, "Directory for the swap files when device is nvme.", kind=str,
                                   optional=True, **_PAR)
    pin_memory: bool = option(True, "Use page-locked CPU buffers.", kind=bool, **_PAR)
    buffer_count: int = option(5, "Pinned buffers for parameter shards swapped to NVMe (at least 2; each the size of "
                              "the largest swapped shard): the host memory they occupy.", kind=int, ge=1, **_PAR)
    buffer_size: int = option(100_000_000, "Largest parameter shard (elements, per rank) a buffer may hold; a "
                             "larger group's shard is an error naming this key.", kind=int, ge=1, **_PAR)
    max_in_cpu: int = option(1_000_000_000, "Elements of parameter shards kept in CPU memory before the rest "
                             "stays on NVMe.", kind=int, ge=0, **_PAR)

    def check(self):
        # as for the optimizer's: the path itself is checked at zerocore.initialize (offload/placement.py)
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(f"{self.PATH}.nvme_path: required when device is 'nvme'")


# DeepSpeed's defaults for zero_optimization.leaf_module (its leaf_module_config.py): the sparse MoE blocks of
# Transformers' Mixtral, Qwen2-MoE and Qwen3-MoE, whose experts run differently on each rank
DEFAULT_LEAF_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


@dataclasses.dataclass
class LeafModuleConfig(_Section):
    PATH = "zero_optimization.leaf_module"
    classes: list = option(list(DEFAULT_LEAF_CLASSES), "Classes of the modules stage 3 gathers whole (no unit "
                           "inside them; zerocore.sharding.leaf_modules): a class's own name or its "
                           "module-qualified name. A string is a list of one.", kind=list, one_is_list=True,
                           applies_if=_only_stage3, applies="stage 3")
    names: list = option([], "Modules gathered whole, by their name in model.named_modules().", kind=list,
                         one_is_list=True, applies_if=_only_stage3, applies="stage 3")
    name_suffixes: list = option([], "Modules gathered whole, by the end of their name in "
                                 "model.named_modules().", kind=list, one_is_list=True, applies_if=_only_stage3,
                                 applies="stage 3")

    def check(self):
        for key in ("classes", "names", "name_suffixes"):
            values = getattr(self, key)
            bad = [v for v in values if not isinstance(v, str) or not v]
            if bad:
                raise ConfigError(f"{self.PATH}.{key}: got {values!r}; allowed: a list of non-empty strings; {bad[0]!r} "
                                  "is not one")
            setattr(self, key, list(dict.fromkeys(values)))  # each once, in order (as DeepSpeed)


@dataclasses.dataclass
class ZeroOptimizationConfig(_Section):
    PATH = "zero_optimization"
    stage: int = option(0, "0: plain data parallel; 1: shard optimizer state; 2: + gradients; "
                        "3: + parameters.", kind=int, choices=(0, 1, 2, 3))
    contiguous_gradients: bool = option(True, "Copy gradients into flat buckets as they are produced.", kind=bool,
                                        no_effect="zerocore always packs gradients into flat buckets")
    reduce_scatter: bool = option(True, "Each rank receives only its reduced slice of the gradients; false: "
                                  "all-reduce whole buckets. On gloo both run as an all-reduce (see above).",
                                  kind=bool)
    overlap_comm: bool | None = option(None, "Reduce full buckets while backward continues (two buckets in "
                                       "flight). null: true at stage 3, else false.", kind=bool, optional=True)
    reduce_dtype: str | None = option(None, "The dtype gradients are summed over ranks in (FSDP2's name). null: the "
                                      "training dtype; \"fp32\": bf16/fp16 gradients are converted to fp32 for the "
                                      "reduction (more accurate sums, twice the bytes on the wire).", kind=str,
                                      optional=True, choices=("fp32",))
    reduce_bucket_size: int = option(500_000_000, "Elements per gradient bucket (= flat group at stages 1/2); a "
                                     "parameter larger than this gets a group of its own.", kind=int, ge=1)
    allgather_bucket_size: int = option(500_000_000, "Elements of parameter all-gathers in flight at once after "
                                        "the optimizer step (stages 1/2).", kind=int, ge=1)
    allgather_partitions: bool = option(True, "Refresh parameters with all-gather (DeepSpeed's false: "
                                        "broadcasts).", kind=bool,
                                        no_effect="zerocore always refreshes parameters with all-gather")
    round_robin_gradients: bool = option(False, "Spread gradient copies to CPU across ranks (offload).", kind=bool,
                                         no_effect="zerocore does this always: every flat group is split evenly "
                                         "over the ranks, so each rank copies its own slice of every reduced "
                                         "bucket to the host as the bucket lands, all ranks at once")
    sub_group_size: int = option(1_000_000_000, "Elements per optimizer-step tile (unit of NVMe swapping).",
                                 kind=int, ge=1, applies_if=lambda c: _only_stage3(c) or _uses_nvme(c),
                                 applies="stage 3 or NVMe offload")
    stage3_prefetch_bucket_size: int = option(50_000_000, "Elements prefetched ahead of use (stage 3).", kind=int,
                                              ge=0, applies_if=_only_stage3, applies="stage 3")
    stage3_param_persistence_threshold: int = option(100_000, "Parameters this small are never partitioned "
                                                     "(stage 3; frozen ones too).", kind=int, ge=0,
                                                     applies_if=_only_stage3, applies="stage 3")
    stage3_max_live_parameters: int = option(1_000_000_000, "Cap on gathered elements resident (stage 3).",
                                             kind=int, ge=0, applies_if=_only_stage3, applies="stage 3")
    stage3_max_reuse_distance: int = option(0, "Keep a unit gathered after its forward when its next use (a "
                                            "second call, or its backward) comes within this many gathered "
                                            "elements. DeepSpeed's default, 1e9, keeps every block of a model "
                                            "under a billion parameters gathered from its forward to its backward "
                                            "(stage 2's memory); zerocore's default 0 frees after each use.",
                                            kind=int, ge=0, applies_if=_only_stage3, applies="stage 3")
    stage3_unit_classes: list = option([], "zerocore: class names of the modules that gather their parameters "
                                       "together (one collective per module), e.g. [\"Block\"], as with FSDP2's "
                                       "fully_shard per block. Empty: chosen by size (stage3_unit_min_params).",
                                       kind=list, applies_if=_only_stage3, applies="stage 3")
    stage3_unit_min_params: int = option(100_000, "zerocore: with no stage3_unit_classes, a child module with at "
                                         "least this many elements to gather (trainable and frozen) becomes a "
                                         "unit (containers and modules holding over half the model are split "
                                         "further).", kind=int,
                                         ge=1, applies_if=_only_stage3, applies="stage 3")
    stage3_persistent_param_names: list = option([], "zerocore: parameters never partitioned at stage 3, by name "
                                                 "(fnmatch patterns over the model's parameter names, e.g. "
                                                 "[\"lm_head.weight\"] or [\"*.lm_head.*\"]): kept whole on every "
                                                 "rank as those under stage3_param_persistence_threshold are (frozen "
                                                 "ones too; trainable ones keep their optimizer state sharded). For "
                                                 "code that reads a weight outside its module's forward, where a "
                                                 "partitioned one is the empty tensor. A pattern matching no "
                                                 "parameter is an error.", kind=list, applies_if=_only_stage3,
                                                 applies="stage 3")
    stage3_gather_for_generation: bool = option(False, "zerocore: generate() of a Transformers model a stage-3 "
                                                "engine holds gathers the whole model once for the call (each rank "
                                                "holds all of it meanwhile) instead of each unit at every forward, "
                                                "that is at every new token. TRL's trainers set it from their "
                                                "ds3_gather_for_generation (default true) unless the config sets "
                                                "it, as TRL gathers DeepSpeed's ZeRO-3 model for generation.",
                                                kind=bool, applies_if=_only_stage3, applies="stage 3")
    stage3_check_divergence: bool = option(True, "zerocore: before each stage-3 collective, check that every rank "
                                           "is about to issue the same one, and raise naming the unit and ranks "
                                           "if not (instead of hanging or crashing).", kind=bool,
                                           applies_if=_only_stage3, applies="stage 3")
    enable_sanity_checks: bool = option(False, "DeepSpeed's debugging checks; here: an in-place edit that "
                                        "zerocore.gathered / GatheredParameters without modifier_rank discards "
                                        "raises a RuntimeError at the block's end (else a warning names it).",
                                        kind=bool)
    stage3_divergence_timeout: float = option(120.0, "zerocore: seconds a rank waits for the others at a stage-3 "
                                              "collective before raising (a rank that stopped issuing them).",
                                              kind=float, gt=0, le=MAX_TIMEOUT_S, applies_if=_only_stage3,
                                              applies="stage 3")
    comm_timeout: float = option(120.0, "zerocore: seconds a collective waits for the other ranks before "
                                 "raising, naming the rank that stopped issuing them (used when zerocore creates the "
                                 "process group from torchrun's environment; a group of your own has the timeout "
                                 "you gave init_process_group).", kind=float, gt=0, le=MAX_TIMEOUT_S)
    agreement_timeout: float = option(120.0, "zerocore: seconds zerocore.initialize waits for every rank to "
                                      "arrive and compare models and configs, before raising naming the ranks "
                                      "that did not.", kind=float, gt=0, le=MAX_TIMEOUT_S)
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, "Gather full 16-bit weights when saving (stage 3).", kind=bool, applies_if=_only_stage3,
        applies="stage 3")
    offload_optimizer: OffloadOptimizerConfig = section(OffloadOptimizerConfig, "Optimizer state offload.")
    offload_param: OffloadParamConfig = section(OffloadParamConfig, "Parameter offload (stage 3 only).")
    leaf_module: LeafModuleConfig = section(LeafModuleConfig, "Leaf modules: modules stage 3 never splits into "
                                            "smaller units (DeepSpeed's ZeRO-3 leaf modules; modules flagged by "
                                            "deepspeed.utils.set_z3_leaf_modules are leaves too).")

    def check(self):
        bad = [c for c in self.stage3_unit_classes if not isinstance(c, str) or not c]
        if bad:
            raise ConfigError(f"{self.PATH}.stage3_unit_classes: got {self.stage3_unit_classes!r}; allowed: a list of "
                              f"class names (strings), e.g. [\"Block\"]; {bad[0]!r} is not one")
        bad = [n for n in self.stage3_persistent_param_names if not isinstance(n, str) or not n]
        if bad:
            raise ConfigError(f"{self.PATH}.stage3_persistent_param_names: got {self.stage3_persistent_param_names!r}; "
                              f"allowed: a list of parameter names or fnmatch patterns (strings), e.g. "
                              f"[\"lm_head.weight\"]; {bad[0]!r} is not one")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ConfigError(f"{self.PATH}.offload_param.device: {self.offload_param.device!r} needs stage 3 "
                              f"(got stage {self.stage}); allowed at this stage: 'none'")
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ConfigError(f"{self.PATH}.offload_optimizer.device: {self.offload_optimizer.device!r} needs stage "
                              "1, 2 or 3 (got stage 0: the optimizer state is not sharded); allowed at stage 0: "
                              "'none'")

    @property
    def overlap(self) -> bool:
        """overlap_comm with its stage-dependent default applied."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


@dataclasses.dataclass
class FP16Config(_Section):
    PATH = "fp16"
    enabled: bool = option(False, "Train with fp16 parameters and gradients, an fp32 master and loss scaling.",
                           kind=bool)
    loss_scale: float = option(0.0, "0: dynamic loss scaling; > 0: this static scale.", kind=float, ge=0.0,
                               number_in_string=True)
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.", kind=int, ge=0,
                                      le=64)
    loss_scale_window: int = option(1000, "Steps without overflow before the scale doubles: it doubles at the end of "
                                    "the next clean one, then every this many (DeepSpeed's rule since 0.17.1).",
                                    kind=int, allowed="an integer; >= 1 where the dynamic scale uses it (enabled, "
                                    "loss_scale 0), any otherwise (as DeepSpeed)")
    hysteresis: int = option(2, "Overflows tolerated before the scale is lowered, at stages 1-3; at stage 0 every "
                                "overflow lowers it (as DeepSpeed's stage-0 fp16 optimizers do).", kind=int, ge=1)
    consecutive_hysteresis: bool = option(False, "Refill hysteresis after every step without overflow.",
                                          kind=bool)
    min_loss_scale: float = option(1.0, "The scale never goes below this; training continues there with a "
                                   "warning.", kind=float, allowed="a number; > 0 where the dynamic scale uses it "
                                   "(enabled, loss_scale 0), any otherwise (as DeepSpeed)")

    def check(self):
        if self.enabled and self.loss_scale == 0:  # the dynamic scale reads these two; nothing else does
            if self.loss_scale_window < 1:
                raise ConfigError(f"{self.PATH}.loss_scale_window: got {self.loss_scale_window}; allowed: an integer "
                                  ">= 1 with the dynamic loss scale (fp16.enabled with fp16.loss_scale 0)")
            if not self.min_loss_scale > 0:
                raise ConfigError(f"{self.PATH}.min_loss_scale: got {self.min_loss_scale:g}; allowed: a number > 0 "
                                  "with the dynamic loss scale (fp16.enabled with fp16.loss_scale 0)")
        if self.enabled and self.loss_scale == 0 and self.min_loss_scale > 2.0 ** self.initial_scale_power:
            raise ConfigError(f"{self.PATH}.min_loss_scale: got {self.min_loss_scale:g}, above the initial scale "
                              f"2**{self.PATH}.initial_scale_power = {2.0 ** self.initial_scale_power:g}; allowed: at "
                              "most the initial scale")


@dataclasses.dataclass
class BF16Config(_Section):
    PATH = "bf16"
    enabled: bool = option(False, "Train with bf16 parameters and gradients and an fp32 master.", kind=bool)
    check_grad_overflow: bool = option(
        True, "Skip the update of an accumulation boundary whose gradients hold Inf/NaN (counted in skipped_steps, "
        "the lr schedule not stepped), as fp16 does (DeepSpeed's default: nothing is lost to a NaN). The Adam kernel "
        "skips on the device and the host learns it at the next step() or when asked (skipped_steps, overflow, "
        "get_lr()): no wait in the step. With a client torch optimizer the host reads the flag once per boundary. "
        "false: such gradients go into the update as with torch.optim and FSDP, and get_global_grad_norm() reads inf "
        "(with offload the flag is host data already and such a step is skipped either way). Engines of "
        "zerocore.deepspeed.initialize skip where DeepSpeed 0.19.8 skips: also fp32 at stages 1-3 and bf16 at stage 3 "
        "whatever this key says (zerocore/deepspeed/semantics.py).", kind=bool)


KEEP = "keep"  # data_types.buffer_dtype: every buffer keeps its dtype (DeepSpeed's null)
# DeepSpeed's spellings of a dtype (its DtypeEnum) -> the canonical one
DTYPE_SPELLINGS = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
                   "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                   "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}
_ANY_DTYPE = "one of " + ", ".join(f'"{k}"' for k in DTYPE_SPELLINGS)  # (the allowed values of a dtype option)


@dataclasses.dataclass
class DataTypesConfig(_Section):
    """DeepSpeed's ``data_types`` section: the dtype of the model's buffers and of the accumulated gradients.
    Its ``param_dtype`` is checked and dropped by ``compat/deepspeed.py`` (it asks for nothing zerocore does not
    do, or is refused as DeepSpeed refuses it); so are the ``grad_accum_dtype`` mixes DeepSpeed refuses."""

    PATH = "data_types"
    buffer_dtype: str | None = option(
        None, "The dtype floating buffers train in under bf16/fp16: fp16, bf16, fp32 (or DeepSpeed's other spellings: "
        "float16, half, bfloat16, float32, float, torch.float16, ...); \"keep\" (zerocore): each buffer keeps the "
        "dtype it had when given to initialize (an fp32 rotary inv_freq stays fp32), as torch AMP and FSDP2 do; "
        "the running statistics of a normalization layer with weights (BatchNorm, InstanceNorm) still take the "
        "training dtype, since its kernels refuse bf16/fp16 weights beside fp32 statistics. null: "
        "zerocore.initialize keeps the buffers of a Transformers model (as \"keep\") and casts the other buffers to "
        "the training dtype (a custom model's fp32 buffer would make its 16-bit activations fp32); "
        "zerocore.deepspeed.initialize reads null as DeepSpeed 0.19.8 does, as \"keep\". Parameters always train in "
        "the training dtype; under fp32 training every floating buffer becomes fp32.", kind=str, optional=True,
        allowed="null, \"keep\" or " + _ANY_DTYPE)
    grad_accum_dtype: str | None = option(
        None, "The dtype gradients accumulate in across micro-batches: \"fp32\" with bf16 training at ZeRO stage 1 "
        "and no optimizer offload keeps a full fp32 gradient buffer (2 bytes a parameter more than bf16's), each "
        "backward's bf16 gradients added into it and reduced in fp32 (DeepSpeed's BF16 optimizer; .grad is None "
        "between backward and step there, as in DeepSpeed). Elsewhere gradients accumulate in the training dtype "
        "whatever it says, as DeepSpeed's ZeRO optimizer does; at stage 0 a dtype other than the training dtype is "
        "refused, as DeepSpeed refuses it.", kind=str, optional=True, allowed="null or " + _ANY_DTYPE)
    master_init: str = option(
        "given", "Where the fp32 master weights of bf16/fp16 training start: \"given\": the values the model held at "
        "initialize, unrounded (as FSDP2 and torch AMP keep fp32 weights); \"rounded\": those values rounded to the "
        "training dtype first, the values the 16-bit model itself starts from (DeepSpeed's: it converts the model, "
        "then copies its master from it; zerocore.deepspeed.initialize uses it unless the config names one). The "
        "two differ by at most half a 16-bit unit at the start.", kind=str, allowed="\"given\" or \"rounded\"")
    keep_in_fp32_modules: object = option(
        "auto", "Floating buffers whose full name matches one of these patterns (`*`: any characters; a pattern "
        "may match anywhere in the name) become fp32 and stay fp32 under bf16/fp16, whatever buffer_dtype says. "
        "\"auto\": the model's Transformers lists (_keep_in_fp32_modules_strict, and _keep_in_fp32_modules under "
        "fp16); []: none.", allowed="\"auto\" or a list of name patterns (strings)",
        auto_is_value=True)

    def _canonical_dtype(self, key: str, others: str, why: str = "") -> None:
        """``key``'s value (a dtype in any of DeepSpeed's spellings) as its canonical name, else a ConfigError
        naming the key; ``others``: the allowed values besides the dtypes, as the message lists them."""
        value = getattr(self, key)
        if value not in DTYPE_SPELLINGS:
            raise ConfigError(f"{self.PATH}.{key}: got {value!r}{why}; allowed: {others} "
                              f"one of {', '.join(repr(k) for k in DTYPE_SPELLINGS)}")
        setattr(self, key, DTYPE_SPELLINGS[value])

    def check(self):
        if self.buffer_dtype is not None and self.buffer_dtype != KEEP:
            why = (" (integer buffers cannot train; DeepSpeed would cast floating buffers to int8)"
                   if self.buffer_dtype in ("int8", "torch.int8") else "")
            self._canonical_dtype("buffer_dtype", "null, 'keep' or", why)
        if self.grad_accum_dtype is not None:
            self._canonical_dtype("grad_accum_dtype", "null or")
        if self.master_init not in ("given", "rounded"):
            raise ConfigError(f"{self.PATH}.master_init: got {self.master_init!r}; allowed: \"given\" or \"rounded\"")
        keep = self.keep_in_fp32_modules
        if isinstance(keep, tuple):
            keep = self.keep_in_fp32_modules = list(keep)
        if keep != "auto" and not (isinstance(keep, list) and all(isinstance(n, str) for n in keep)):
            raise ConfigError(f"{self.PATH}.keep_in_fp32_modules: got {keep!r}; allowed: \"auto\" or a list of "
                              "name patterns (strings)")


@dataclasses.dataclass
class OptimizerParams(_Section):
    PATH = "optimizer.params"
    lr: float = option(1e-3, "Learning rate.", kind=float, ge=0.0)
    betas: list = option([0.9, 0.999], "Adam's (beta1, beta2).", kind=list,
                         allowed="two numbers in [0, 1)")
    eps: float = option(1e-8, "Added to the denominator.", kind=float, ge=0.0)
    weight_decay: float = option(0.0, "Weight decay (DeepSpeed's default 0, unlike torch.optim.AdamW's 0.01).",
                                 kind=float, ge=0.0)
    adam_w_mode: bool = option(True, "For type Adam: decoupled decay (AdamW) when true, as in DeepSpeed; "
                               "L2 added to the gradient when false.", kind=bool)

    def check(self):
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                           for b in self.betas):
            raise ConfigError(f"{self.PATH}.betas: got {self.betas!r}; allowed: two numbers in [0, 1)")
        self.betas = [float(b) for b in self.betas]


@dataclasses.dataclass
class OptimizerConfig(_Section):
    PATH = "optimizer"
    type: str = option("AdamW", "Adam or AdamW (the fused Adam kernel on the owned shard).", kind=str,
                       choices=("Adam", "AdamW"))
    params: OptimizerParams = section(OptimizerParams, "Optimizer hyper-parameters.")

    @property
    def decoupled(self) -> bool:
        return self.type == "AdamW" or self.params.adam_w_mode


@dataclasses.dataclass
class SchedulerConfig(_Section):
    PATH = "scheduler"
    type: str | None = option(None, "Learning-rate schedule stepped at each accumulation boundary: WarmupLR, "
                              "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (DeepSpeed's formulas) or the "
                              "name of a torch.optim.lr_scheduler class; null: none. A scheduler passed to "
                              "initialize wins over this section.", kind=str, optional=True)
    params: dict = option({}, "The schedule's parameters (keyword arguments of its class, checked against it).",
                          kind=dict)

    def check(self):
        from ..schedules import check_params

        if self.type is None:
            if self.params:
                raise ConfigError("scheduler.params: given without scheduler.type; name the schedule")
            return
        try:
            check_params(self.type, self.params)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass
class AioConfig(_Section):
    """Used by NVMe offload and by checkpoint save/load (its O_DIRECT files): no key is ever without effect."""

    PATH = "aio"
    block_size: int = option(1_048_576, "Bytes per NVMe read/write request.", kind=int, ge=4096)
    queue_depth: int = option(8, "Requests in flight per worker.", kind=int, ge=1)
    intra_op_parallelism: int = option(1, "I/O worker threads.", kind=int, ge=1)
    single_submit: bool = option(False, "Submit requests one at a time instead of in batches.", kind=bool)
    overlap_events: bool = option(True, "Overlap submission and completion handling.", kind=bool)
    backend: str = option("auto", "How the NVMe engine issues its I/O: libaio, io_uring, or threadpool (blocking "
                          "pread/pwrite on queue_depth threads per worker: needs no kernel AIO, slower); auto: the "
                          "first of those usable here (`zerocore env` names it).", kind=str, choices=AIO_BACKENDS)


@dataclasses.dataclass
class CheckpointConfig(_Section):
    PATH = "checkpoint"
    tag_validation: str = option("WARN", "When save_checkpoint is given different tags on different ranks: WARN "
                                 "(warn, and save under rank 0's tag), IGNORE (save under rank 0's tag), FAIL (raise "
                                 "on every rank, nothing saved). Case-insensitive.", kind=str,
                                 choices=("WARN", "IGNORE", "FAIL"))


AUTOCAST_DTYPES = {k: v for k, v in DTYPE_SPELLINGS.items() if v in ("bf16", "fp16")}


@dataclasses.dataclass
class TorchAutocastConfig(_Section):
    """DeepSpeed's ``torch_autocast``: torch's own mixed precision inside the engine's forward."""

    PATH = "torch_autocast"
    enabled: bool = option(
        False, "Run every forward through the engine under torch.autocast(dtype), as torch AMP does: parameters, "
        "gradients, the reductions and the optimizer stay in the training dtype (fp32 unless fp16/bf16 is enabled), "
        "the operations autocast lowers (matrix products, convolutions) compute in `dtype`. An autocast the caller "
        "opened around the engine is replaced by this one inside it (DeepSpeed's rule). float16 has no loss scale "
        "here (as DeepSpeed's ZeRO stages 1-3), so it is refused at stage 0, where DeepSpeed adds torch's GradScaler.",
        kind=bool)
    dtype: str | None = option(None, "The autocast dtype; null: the device's autocast default "
                               "(torch.get_autocast_dtype: bfloat16 on CPU, float16 on CUDA).", kind=str,
                               optional=True, allowed="null or one of " + ", ".join(f'"{k}"' for k in AUTOCAST_DTYPES))
    lower_precision_safe_modules: list | None = option(
        None, "DeepSpeed reduces (and at stage 3 gathers) the parameters of these module classes (default: Linear "
        "and Conv) in the autocast dtype; zerocore communicates every parameter and gradient in the training dtype "
        "(zero_optimization.reduce_dtype where set), the precision torch AMP has.", kind=list, optional=True,
        no_effect="zerocore reduces and gathers every parameter in the training dtype (or "
        "zero_optimization.reduce_dtype), not these modules' in the autocast dtype")

    def check(self):
        if self.dtype is not None and self.dtype not in AUTOCAST_DTYPES:
            raise ConfigError(f"{self.PATH}.dtype: got {self.dtype!r}; allowed: null or one of "
                              + ", ".join(repr(k) for k in AUTOCAST_DTYPES))


@dataclasses.dataclass
class ZeroConfig(_Section):
    """The whole zerocore config (DeepSpeed ``ds_config.json`` layout)."""

    PATH = ""
    train_batch_size: int | None = option(None, "Global batch = micro batch x accumulation x ranks.", kind=int,
                                          ge=1, optional=True)
    train_micro_batch_size_per_gpu: int | None = option(None, "Samples per rank per forward/backward.", kind=int,
                                                        ge=1, optional=True)
    gradient_accumulation_steps: int | None = option(None, "Micro-batches per optimizer step (null: derived from "
                                                     "the batch sizes, else 1).", kind=int, ge=1, le=MAX_ACCUMULATION,
                                                     optional=True)
    gradient_clipping: float = option(1.0, "Clip the global gradient norm (over all ranks) to this; 0: off. "
                                      "DeepSpeed 0.19's default is 1.0 too (GRADIENT_CLIPPING_DEFAULT).",
                                      kind=float, ge=0.0)
    managed_gradient_accumulation: bool = option(
        True, "false: the caller's step() ends each accumulation window (DeepSpeed 0.19's): backward() only "
        "accumulates (stages 0/1 reduce in step(), stages 2/3 every backward as always) and every step() updates, "
        "whatever number of backward() calls came before it; the loss is still divided by gradient_accumulation_steps "
        "(backward(loss, scale_wrt_gas=False) to divide it yourself); set_gradient_accumulation_boundary is refused.",
        kind=bool)
    dataloader_drop_last: bool = option(False, "The training data loader (initialize(training_data=...)) drops "
                                        "each rank's last incomplete micro-batch.", kind=bool)
    optimizer: OptimizerConfig = section(OptimizerConfig, "The optimizer.")
    scheduler: SchedulerConfig = section(SchedulerConfig, "The learning-rate schedule.")
    zero_allow_untested_optimizer: bool = option(False, "zerocore.initialize steps any "
                                                 "torch.optim.Optimizer passed to it on its flat shards whatever "
                                                 "this says; zerocore.deepspeed.initialize follows DeepSpeed (false: "
                                                 "a client optimizer of a type DeepSpeed has not tested is refused at "
                                                 "stages 1-3).", kind=bool)
    fp16: FP16Config = section(FP16Config, "fp16 mixed precision.")
    bf16: BF16Config = section(BF16Config, "bf16 mixed precision.")
    data_types: DataTypesConfig = section(DataTypesConfig, "The dtype of the model's buffers.")
    zero_optimization: ZeroOptimizationConfig = section(ZeroOptimizationConfig, "ZeRO sharding.")
    aio: AioConfig = section(AioConfig, "NVMe I/O engine settings (NVMe offload and checkpoint files).")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "save_checkpoint's checks.")
    torch_autocast: TorchAutocastConfig = section(TorchAutocastConfig, "torch.autocast inside the engine's forward.")

    def check(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled: got both true; allowed: at most one")
        ac = self.torch_autocast
        if ac.enabled and ac.dtype is not None and AUTOCAST_DTYPES[ac.dtype] == "fp16" and \
                self.zero_optimization.stage == 0:
            raise ConfigError(f"torch_autocast.dtype: got {ac.dtype!r} at zero_optimization.stage 0; allowed there: "
                              "a bfloat16 spelling (float16 autocast needs a loss scale, which DeepSpeed adds at stage "
                              "0 with torch's GradScaler and zerocore applies only with fp16.enabled)")

    def batch_sizes(self, world_size: int) -> tuple[int, int | None, int | None]:
        """(accumulation steps, micro batch, global batch) resolved DeepSpeed's way (``resolve_batch_sizes``)."""
        return resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                   self.gradient_accumulation_steps, world_size)


def resolve_batch_sizes(tb: int | None, mb: int | None, ga: int | None,
                        world_size) -> tuple[int, int | None, int | None]:
    """(accumulation steps, micro batch, global batch) from ``train_batch_size``, ``train_micro_batch_size_per_gpu``
    and ``gradient_accumulation_steps`` (each possibly None) over ``world_size`` ranks, DeepSpeed's way: any two
    of the three determine the third, one alone with accumulation 1; all three given must agree. The engine's
    rule and the DeepSpeed face's ``DeepSpeedConfig``'s (which raises DeepSpeed's AssertionErrors from it)."""
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * world_size:
            raise ConfigError(f"train_batch_size: got {tb}; must equal train_micro_batch_size_per_gpu ({mb}) x "
                              f"gradient_accumulation_steps ({ga}) x ranks ({world_size}) = {mb * ga * world_size}")
    elif tb is not None and mb is not None:
        ga, rem = divmod(tb, mb * world_size)
        if rem or ga < 1:
            raise ConfigError(f"train_batch_size: got {tb}; must be a multiple of train_micro_batch_size_per_gpu "
                              f"({mb}) x ranks ({world_size})")
    elif tb is not None:
        ga = ga or 1
        mb, rem = divmod(tb, ga * world_size)
        if rem or mb < 1:
            raise ConfigError(f"train_batch_size: got {tb}; must be a multiple of gradient_accumulation_steps "
                              f"({ga}) x ranks ({world_size})")
    else:
        ga = ga or 1
        if mb is not None:
            tb = mb * ga * world_size
    return ga, mb, tb
