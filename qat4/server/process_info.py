"""What the server's /health says about its process: the device it computes on, its memory, its
uptime. Each answer costs a few counter reads: no device sync, no allocation."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from qat4 import __version__

MIB = 1 << 20


def device_label(device: torch.device | str) -> str:
    """The device as 'cpu' or 'cuda:N' (a bare 'cuda' by the index it runs on)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform calls the machine."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(label: str) -> str:
    """The GPU's name for a cuda device, the CPU's model name for the CPU."""
    return torch.cuda.get_device_name(torch.device(label)) if label.startswith("cuda") else cpu_name()


def resident_mib() -> float:
    """This process's resident memory in MiB (/proc/self/statm), or 0.0 where there is no /proc."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MIB


class ProcessInfo:
    """The server process's part of /health, for an engine on `device`; uptime counts from creation."""

    def __init__(self, device: torch.device | str):
        self.device = device_label(device)
        self.device_name = device_name(self.device)
        self.started = time.monotonic()

    def identity(self) -> dict:
        """pid, qat4's version, the device and its name, seconds up."""
        return {"pid": os.getpid(), "version": __version__, "device": self.device, "device_name": self.device_name,
                "uptime_s": round(time.monotonic() - self.started, 1)}

    def memory(self) -> dict:
        """MiB: the process's resident memory, and on a GPU what torch's allocator has handed out
        (allocated) and holds (reserved) there."""
        memory = {"resident_mib": round(resident_mib(), 1)}
        if self.device.startswith("cuda"):
            memory["allocated_mib"] = round(torch.cuda.memory_allocated(self.device) / MIB, 1)
            memory["reserved_mib"] = round(torch.cuda.memory_reserved(self.device) / MIB, 1)
        return memory
