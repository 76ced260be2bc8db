"""``deepspeed.runtime.swap_tensor``: the sizes DeepSpeed's NVMe swapping is built on, which scripts and tests
size their tensors by (zerocore's own swapping is ``zerocore.offload.nvme``)."""
MIN_AIO_BYTES = 1024 ** 2
AIO_ALIGNED_BYTES = 1024
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES
