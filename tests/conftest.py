"""Session fixtures shared by the test files: the tiny random-weight model is built once per session."""
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    "A tiny random-weight Llama chat model (medsafe_nb.testing.doubles), built once per session: a chance-level control"
    from medsafe_nb.testing.doubles import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_dir):
    "An HFBackend on the tiny model (CPU, fp32, greedy, batch size 4), loaded once per session"
    from transformers.utils import logging as hf_logging
    from medsafe_nb.models.hf import HFBackend
    hf_logging.disable_progress_bar()
    b = HFBackend(str(tiny_model_dir), batch_size=4, max_new_tokens=8)
    yield b
    b.close()


@pytest.fixture(scope="session")
def minilm_run_dir(tmp_path_factory):
    "A run of the MiniLM baseline on the first 24 sample items (all three conditions), made once per session"
    from medsafe_nb.run.runner import run
    out = tmp_path_factory.mktemp("minilm") / "run"
    run(model="minilm", data="sample", out=str(out), limit=24, progress=False)
    return out


CHROMIUM = "/usr/bin/chromium"   # Debian's chromium (`make browser`); playwright cannot download its own browsers here
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]   # no background traffic: the machine has no network


def browser_missing()->str|None:
    "Why the browser tests cannot run here, or None"
    from pathlib import Path
    if not Path(CHROMIUM).exists(): return f"{CHROMIUM} is missing: run `make browser` (installs the Debian chromium package)"
    try: import playwright.sync_api  # noqa: F401
    except ImportError: return "the playwright package is missing: run `make browser`"
    return None


@pytest.fixture(scope="session")
def browser():
    "Headless Chromium driven by playwright, started once per session"
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: real components end to end (a vLLM server, Chromium, the harness venv, "
                                       "papermill runs, kill -9 trials, torchrun): `make test-integration`, run by CI")


def screenshot_path(name:str):
    "Where a browser test saves its screenshot: nbs/images/ (the docs) with MEDSAFE_UPDATE_SCREENSHOTS=1, else a temporary folder"
    import os, tempfile
    from pathlib import Path
    if os.environ.get("MEDSAFE_UPDATE_SCREENSHOTS"): return Path(__file__).resolve().parents[1] / "nbs" / "images" / name
    return Path(tempfile.mkdtemp(prefix="medsafe-shots-")) / name


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """The packaged SmolLM2-135M-Instruct GGUF (`smollm2`) dequantized once per session into a temporary GGUF cache
    (MEDSAFE_GGUF_CACHE points there for the whole session); skips, saying how to install it, where it is missing"""
    import time
    from types import SimpleNamespace
    from medsafe_nb.core import ConfigError
    from medsafe_nb.models.gguf import smollm2_gguf, gguf_checkpoint, GGUF_CACHE_ENV
    try: gguf = smollm2_gguf()
    except ConfigError as e: pytest.skip(str(e))
    cache = tmp_path_factory.mktemp("gguf-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv(GGUF_CACHE_ENV, str(cache))
    t0 = time.perf_counter()
    folder, sha = gguf_checkpoint(gguf)
    yield SimpleNamespace(gguf=gguf, cache=cache, folder=folder, sha256=sha, build_s=time.perf_counter() - t0)
    mp.undo()
