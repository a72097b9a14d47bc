import pytest

from gouache.models.zoo import load_pipeline


@pytest.fixture(scope="session")
def pipes():
    """Built-in tiny pipelines, built once per test session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_pipeline(name)
            cache[name].set_progress_bar_config(disable=True)
        return cache[name]

    return get
