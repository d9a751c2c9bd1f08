"""tests/gpu: acceptance on a CUDA GPU node (marker `gpu`), skipped with the reason elsewhere."""


def pytest_configure(config):
    # Registered here too, so `pytest tests/gpu` collects under --strict-markers on its own.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU node; skipped without one")
