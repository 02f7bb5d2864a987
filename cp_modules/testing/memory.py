"""Peak host-memory growth of a call, for memory-contract tests (Linux)."""

from __future__ import annotations

import ctypes
import gc
import re
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["peak_rss_growth", "rss_bytes"]

T = TypeVar("T")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(m.group(1))


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_kib("VmRSS") * 1024


def _release_freed() -> None:
    """Return freed heap memory to the system, so the RSS at the start holds only live data
    (otherwise a call that reuses memory freed before it looks smaller than it is)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def peak_rss_growth(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, int]:
    """Call ``fn`` and return ``(its result, the peak growth of resident memory during it)``.

    The kernel's peak-RSS mark (``VmHWM``) is reset to the current RSS just before the call
    (``/proc/self/clear_refs``), after freed heap memory went back to the system, so the growth is the high-water mark of the call itself over the
    memory held when it started, file-backed pages included.
    """
    _release_freed()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss_bytes()
    out = fn(*args, **kwargs)
    peak = _status_kib("VmHWM") * 1024
    return out, max(0, peak - start)
