"""Fail early, with one line, when an allocation cannot fit in the machine's memory."""
import os

from nbmoe.errors import NbmoeError


def available_bytes():
    """MemAvailable from /proc/meminfo (Linux), else the physical memory size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(n_bytes, what):
    free = available_bytes()
    if n_bytes > free:
        raise NbmoeError(f"not enough memory for {what}: needs {n_bytes / 2**30:.2f} GiB, "
                         f"{free / 2**30:.2f} GiB available (try a smaller -c)")
