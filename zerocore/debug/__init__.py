"""Debugging aids. ``host_waits``: count (or raise on) every place the host waits for the device."""
from .host_waits import HostWait, HostWaitLog, HostWaitError, host_waits, mark_host, device_read

__all__ = ["HostWait", "HostWaitLog", "HostWaitError", "host_waits", "mark_host", "device_read"]
