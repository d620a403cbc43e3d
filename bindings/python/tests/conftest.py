"""Fixtures shared by the Python package's tests: the real models (each loaded once per pytest
run; a test that adds hooks removes them) and numpy results for the modules that ask for them."""

import pytest

import attnscope


@pytest.fixture(scope="session")
def smol():
    return attnscope.HookedModel.from_pretrained("smollm2-135m")


@pytest.fixture(scope="session")
def qwen():
    return attnscope.HookedModel.from_pretrained("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def minilm():
    return attnscope.HookedModel.from_pretrained("all-minilm-l6-v2")


@pytest.fixture
def numpy_results():
    """Results as numpy arrays for the test, then the default again (use it with
    `pytestmark = pytest.mark.usefixtures("numpy_results")`)."""
    attnscope.set_array_type("numpy")
    yield
    attnscope.set_array_type("auto")
