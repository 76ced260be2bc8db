"""Debugging aids. ``host_waits``: count (or raise on) every place the host waits for the device.
``partitioned_reads``: name (or raise on) every use of a stage-3 parameter while it is partitioned."""
from .host_waits import HostWait, HostWaitLog, HostWaitError, host_waits, mark_host, device_read
from .partitioned_reads import PartitionedRead, PartitionedReadError, PartitionedReadLog, partitioned_reads

__all__ = ["HostWait", "HostWaitLog", "HostWaitError", "host_waits", "mark_host", "device_read", "PartitionedRead",
           "PartitionedReadError", "PartitionedReadLog", "partitioned_reads"]
