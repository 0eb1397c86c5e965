import pytest

from tests.model_factory import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
