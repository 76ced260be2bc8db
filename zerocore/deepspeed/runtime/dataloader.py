"""``deepspeed.runtime.dataloader.RepeatingLoader`` (also ``deepspeed.utils.RepeatingLoader``): an iterable
iterated again from its start each time it runs out, for loops that count steps, not epochs (DeepSpeed's
pipeline examples: ``engine.train_batch(data_iter=RepeatingLoader(loader))``). DeepSpeed's semantics: an empty
iterable ends the iteration (StopIteration) rather than looping forever; nothing is reshuffled by this wrapper
(a ``DistributedSampler``'s order changes only where the caller calls ``set_epoch``)."""
from __future__ import annotations


class RepeatingLoader:
    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
