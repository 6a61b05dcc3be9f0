import os
import tempfile

import pytest
import torch

# Proofs are cached on disk (`attngraph.compiler.proof_cache`); a test run starts cold and
# leaves the user's cache alone.
os.environ.setdefault("ATTNGRAPH_CACHE_DIR", tempfile.mkdtemp(prefix="attngraph-test-cache-"))

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before the first
    # `import triton` (which `import attngraph` triggers through inductor).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo(request):
    """Fresh Dynamo caches per test (tests compile the same HF forward many times), except in
    modules that share one compiled model across tests (marked ``keep_dynamo_cache``)."""
    import torch._dynamo

    if request.node.get_closest_marker("keep_dynamo_cache") is None:
        torch._dynamo.reset()
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (bit-identity and exact-token checks: reductions then
    run in one fixed order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def poison_empty():
    """``torch.empty`` returns NaN-filled tensors for the duration of a test: a value a kernel
    fails to write shows up as NaN."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = was_fill
    torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
