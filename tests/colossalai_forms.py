"""ColossalAI's ZeRO configuration form, its four dicts as ColossalAI's examples write them (a
``zero`` dict of level, loss scaling and ``*_config`` offload sections), shared by the config tests."""
MAX_IN_CPU = 2_000_000


def colossalai_forms(nvme_path):
    optimizer = dict(type='Adam', lr=0.001, weight_decay=0)
    first = dict(type='ZeroRedundancyOptimizer_Level_3', dynamic_loss_scale=True, clip_grad=1.0)
    second = dict(offload_optimizer_config=dict(device='cpu', pin_memory=True, fast_init=True), **first)
    third = dict(offload_optimizer_config=dict(device='cpu', pin_memory=True, fast_init=True),
                 offload_param_config=dict(device='cpu', pin_memory=True, fast_init=MAX_IN_CPU), **first)
    fourth = dict(offload_optimizer_config=dict(device='nvme', pin_memory=True, fast_init=True, nvme_path=nvme_path),
                  offload_param_config=dict(device='nvme', pin_memory=True, max_in_cpu=MAX_IN_CPU,
                                            nvme_path=nvme_path), **first)
    return [dict(optimizer=optimizer, zero=z) for z in (first, second, third, fourth)]
