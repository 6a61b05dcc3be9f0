import pytest
import torch


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
