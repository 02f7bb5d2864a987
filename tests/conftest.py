import os

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before the package
# is imported. On a machine without CUDA every Triton kernel runs under the interpreter.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover
        pass

# A private compile cache per test session: torch keys cached compiled graphs (forward and
# backward) on the traced graph, not on the Python autograd formula or schema of the custom
# ops inside it, so a cache written by another version of this package can serve a stale
# backward.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="cp_modules_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models: one thread is fastest, and spin-waiting threads crawl on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
