"""The optional compiled CPU kernels of sparse_sync (``kernels.cpp``): built once per machine, on first use.

Why:
1. On a CPU the framework diff (compare, nonzero, gathers, scatter: one pass over memory each) runs
   at a fraction of the memory bandwidth; ``kernels.cpp`` does the diff of a chunk in one pass, the
   receiver's scatter from int32 positions and the block digest without temporaries.
2. Nothing requires them: the numpy/torch kernels in ``codec`` give the same payloads bit for bit
   (tested) and stay the path on GPUs, when no compiler is present, when the build fails (logged
   once, with the reason) and when ``THUNDERSYNC_SPARSE_NATIVE=0``.
3. The build (``torch.utils.cpp_extension``: g++ and the ninja executable, ~40 s on two cores)
   goes into a cache folder keyed by the torch and Python versions and a hash of the source
   (``$THUNDERSYNC_NATIVE_CACHE``, else ``~/.cache/thundersync_verl/native``): later processes only
   load it (~1 s), and a changed source builds beside the old one instead of over it. No
   ``-march=native``: a cache shared between machines must not hold instructions one of them lacks
   (the AVX2 compare is chosen at run time). A build lock left by a killed build is cleared after
   ``STALE_LOCK_S`` (torch's own lock waits for it forever).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "THUNDERSYNC_SPARSE_NATIVE"
ENV_CACHE = "THUNDERSYNC_NATIVE_CACHE"
SOURCE = Path(__file__).with_name("kernels.cpp")
MODULE_NAME = "thundersync_sparse_sync_kernels"
STALE_LOCK_S = 600.0

_lock = threading.Lock()
_state: dict = {}  # "module": the loaded kernels or None; "why": the reason they are not used


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def cache_dir() -> Path:
    root = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "thundersync_verl" / "native")
    tag = f"torch{torch.__version__.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    return root / tag / source_hash()


def missing_tools() -> str | None:
    """Why the kernels cannot be built here (None: a C++ compiler and ninja are on the PATH)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({compiler} or g++) on the PATH"
    if shutil.which("ninja") is None:
        return "no ninja executable on the PATH (torch.utils.cpp_extension builds with it)"
    return None


def _build():
    from torch.utils.cpp_extension import load_inline

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)  # a build killed midway; torch's baton would wait for it forever
    return load_inline(name=f"{MODULE_NAME}_{source_hash()}", cpp_sources=[SOURCE.read_text()],
                       extra_cflags=["-O3"], build_directory=str(folder), verbose=False)


def kernels():
    """The compiled kernels, building them on the first call; None when they are off or cannot be built."""
    if not enabled_by_env():
        return None
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            why = missing_tools()
            module = None
            if why is None:
                try:
                    module = _build()
                except Exception as exc:  # a failed build leaves the numpy/torch kernels in charge
                    why = f"the build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
            if module is None:
                logger.warning("sparse_sync: compiled CPU kernels unavailable (%s); using the numpy/torch kernels "
                               "(same payloads, slower on CPU)", why)
            _state.update(module=module, why=why)
    return _state["module"]


def why_unavailable() -> str | None:
    """The reason the compiled kernels are not in use (None: they are), building them if not tried yet."""
    if not enabled_by_env():
        return f"{ENV_SWITCH}=0"
    return None if kernels() is not None else _state.get("why")


def usable_for(*tensors: torch.Tensor):
    """The kernels when every tensor is a flat contiguous CPU tensor they can take, else None."""
    for t in tensors:  # a loop, not all(...): this runs once per chunk of every push
        if not (t.is_cpu and t.dim() == 1 and t.is_contiguous()):
            return None
    return kernels()
