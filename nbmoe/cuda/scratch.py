"""What the matrix kernels keep between calls: kernels built per key, device buffers per GPU."""
from numba import cuda

from . import SIM, device_id

_kernels = {}
_buffers = {}
_outgrown = []
_sms = {}
SIM_SMS = 2         # the simulator's stand-in for a GPU's multiprocessors


def sm_count():
    """Multiprocessors of the current GPU (grid sizes that fill it)."""
    if SIM:
        return SIM_SMS
    d = device_id()
    if d not in _sms:
        _sms[d] = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return _sms[d]


def cached(key, build):
    """The kernel of this key (type, sizes, ...), built by build() on first use."""
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = build()
    return k


def buffer(name, n, dtype):
    """A flat device buffer of >= n elements reused across calls (one stream per GPU), one per
    GPU: grown, never freed (a recorded CUDA graph may still use an outgrown one), passed
    whole (kernels index it; slicing a device array costs host time)."""
    key = (device_id(), name)
    b = _buffers.get(key)
    if b is None or b.size < n:
        if b is not None:
            _outgrown.append(b)
        b = _buffers[key] = cuda.device_array(max(n, 1), dtype)
    return b
