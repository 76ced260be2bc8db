"""``deepspeed.utils``' tensor-fragment functions: one parameter's fp32 master (``fp32_param``), Adam moments
(``optimizer_state``, keys ``exp_avg`` / ``exp_avg_sq``) and reduced gradient (``grad``), read and written whole
(``safe_get_full_*``: a collective, every rank calls it for the same parameter) or as this rank's piece
(``safe_get_local_*``), at every stage and with optimizer offload (zerocore/runtime/param_fragments.py says
where each comes from). Returned tensors are fp32 copies on the engine's device, full ones in the parameter's
shape; None for a parameter no engine trains, as DeepSpeed's.

Where zerocore differs: a local piece is the part of the parameter inside this rank's owned range of its flat
group (flattened; possibly empty), not DeepSpeed's per-parameter ``ds_tensor`` partition, and the local
functions work at every stage (DeepSpeed's assert stage 3). A gradient is held after ``engine.backward()`` at an
accumulation boundary until ``engine.step()``, read as the step applies it before clipping (the mean over the
ranks and micro-batches, without the fp16 loss scale); at stages 0/1 inside ``no_sync()`` this rank's own, not
reduced yet; elsewhere reading it raises, naming the state."""
from __future__ import annotations

from ...runtime import param_fragments as _frag

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_grad",
           "safe_set_local_grad", "safe_get_local_fp32_param", "safe_get_local_optimizer_state",
           "safe_set_local_optimizer_state", "safe_set_local_fp32_param", "safe_update_full_grad_vectorized"]


def safe_get_full_fp32_param(param):
    """The parameter's whole fp32 master. A collective."""
    return _frag.full(param, "fp32")


def safe_set_full_fp32_param(param, value) -> None:
    """Replaces the parameter's fp32 master (each rank keeps its piece of ``value``); the 16-bit parameter takes
    it at the next step, as DeepSpeed's."""
    _frag.set_full(param, value, "fp32")


def safe_get_full_optimizer_state(param, optim_state_key):
    """The parameter's whole ``exp_avg`` or ``exp_avg_sq``. A collective."""
    return _frag.full(param, optim_state_key)


def safe_set_full_optimizer_state(param, value, optim_state_key) -> None:
    _frag.set_full(param, value, optim_state_key)


def safe_get_full_grad(param):
    """The parameter's whole gradient as the step applies it (the mean over ranks and micro-batches, unscaled),
    at every stage: a collective from stage 2 on. (DeepSpeed returns ``.grad`` itself where a parameter has
    one; zerocore's ``.grad`` at stages 0/1 holds the ranks' sum, so this returns the mean, a copy.)"""
    return _frag.full(param, "grad")


def safe_set_full_grad(param, value) -> None:
    """Sets the gradient the step applies to ``value`` (a whole gradient; each rank keeps its piece)."""
    _frag.set_full(param, value, "grad")


def safe_get_local_grad(param):
    return _frag.local(param, "grad")


def safe_set_local_grad(param, value) -> None:
    _frag.set_local(param, value, "grad")


def safe_get_local_fp32_param(param):
    return _frag.local(param, "fp32")


def safe_get_local_optimizer_state(param, optim_state_key):
    return _frag.local(param, optim_state_key)


def safe_set_local_optimizer_state(param, value, optim_state_key) -> None:
    _frag.set_local(param, value, optim_state_key)


def safe_set_local_fp32_param(param, value) -> None:
    _frag.set_local(param, value, "fp32")


def safe_update_full_grad_vectorized(param_list, update_func) -> None:
    """For each trained parameter, its gradient replaced by ``update_func(full gradient, param)``: a collective
    from stage 2 on (every rank passes the same list)."""
    with _frag.landing_once():
        for p in param_list:
            if p.requires_grad:
                old = _frag.full(p, "grad")
                if old is not None:
                    _frag.set_full(p, update_func(old, p), "grad")
