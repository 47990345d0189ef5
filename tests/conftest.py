"""Session fixtures shared by the test files: the tiny random-weight model is built once per session."""
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    "A tiny random-weight Llama chat model (medsafe_nb.testing), built once per session: a chance-level control"
    from medsafe_nb.testing import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_dir):
    "An HFBackend on the tiny model (CPU, fp32, greedy, batch size 4), loaded once per session"
    from transformers.utils import logging as hf_logging
    from medsafe_nb.hf import HFBackend
    hf_logging.disable_progress_bar()
    b = HFBackend(str(tiny_model_dir), batch_size=4, max_new_tokens=8)
    yield b
    b.close()
