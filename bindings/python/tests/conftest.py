"""Fixtures shared by the Python package's tests: the real models (each loaded once per pytest
run; a test that adds hooks removes them) and numpy results for the modules that ask for them.
The models are loaded unprocessed (the checkpoint's weights, which the references were made
from): ``from_pretrained``'s default is TransformerLens's processing (test_processing.py)."""

import pytest

import attnscope

# test_tl_real.py and test_tl_patching.py run where real TransformerLens is installed, and
# test_patching_torch.py where torch is (target/tlenv: tl_env.sh; CI runs them there, tests/python.rs)
collect_ignore = []
try:
    import transformer_lens  # noqa: F401
except ImportError:
    collect_ignore += ["test_tl_real.py", "test_tl_patching.py"]
try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError:
    collect_ignore += ["test_patching_torch.py"]


def pytest_terminal_summary(terminalreporter):
    """Says loudly that the comparison with real TransformerLens did not run here (CI runs it in
    target/tlenv, which bindings/python/tests/tl_env.sh makes: tests/python.rs)."""
    if collect_ignore:
        terminalreporter.write_line(f"NOTE: {', '.join(collect_ignore)} NOT collected: transformer_lens or torch is not installed "
                                    "here (tests/python.rs runs them in target/tlenv: bindings/python/tests/tl_env.sh makes it)", yellow=True, bold=True)


@pytest.fixture(scope="session")
def smol():
    return attnscope.HookedModel.from_pretrained_no_processing("smollm2-135m")


@pytest.fixture(scope="session")
def qwen():
    return attnscope.HookedModel.from_pretrained_no_processing("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def minilm():
    return attnscope.HookedModel.from_pretrained_no_processing("all-minilm-l6-v2")


@pytest.fixture
def numpy_results():
    """Results as numpy arrays for the test, then the default again (use it with
    `pytestmark = pytest.mark.usefixtures("numpy_results")`)."""
    attnscope.set_array_type("numpy")
    yield
    attnscope.set_array_type("auto")
