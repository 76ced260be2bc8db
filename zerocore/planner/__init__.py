"""Memory planning: what one training step of zerocore will hold per rank, before anything is
allocated.

``dry_engine`` builds the engine's own groups, shards (with their offload placement), reducer
buckets and stage-3 gatherer on fake tensors; ``trace`` runs one step there under torch's
``MemTracker``; ``core`` extends short traces of a deep model to its full depth; ``estimate``
(``api``) plans one or every sensible configuration and ``recommend`` picks one; ``measure`` is
the measured side the accuracy benchmark checks the predictions against.

Built on torch 2.13's tools, and where they fall short for this:

- ``FakeTensorMode`` runs the model and the engine's Python with no memory, but zerocore's native
  kernels need real pointers (``fake_ops`` answers them for fake tensors: they work in place), and
  the NVMe shard's constructor writes swap files (``dry_engine.PlannedNvmeShard`` holds its tensors).
- ``MemTracker`` follows storages and ``UntypedStorage.resize_`` (stage 3's gather/free), but knows
  only parameters/gradients/activations, not the engine's roles (the breakdown is read from the
  dry engine at each new peak), sees nothing allocated on another thread (gloo's all-gather
  scratch: reported beside the peak) and its per-module peak bookkeeping is not needed here.
- ``fsdp2_mem_tracker`` needs modules wrapped by ``fully_shard``; zerocore's units are not, so it
  does not apply. ``runtime_estimator`` (time) and ``sac_estimator`` (which ops to recompute under
  selective checkpointing) answer other questions; activation checkpointing here is whole-block
  (``batches.enable_checkpointing``), traced like any other step.
"""
from .api import estimate

__all__ = ["estimate"]
