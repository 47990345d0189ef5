"""Several base URLs (`--base-url URL,URL`): load spread across real local servers, a dead or failing endpoint taken
out of rotation, and results identical to one URL."""
import pandas as pd
import pytest

from medsafe_nb.models.openai import OpenAIBackend
from medsafe_nb.models.base import GenRequest
from medsafe_nb.items.release import load_medmisbench
from medsafe_nb.testing.mockserver import MockServer
from medsafe_nb.run.predict import run_benchmark

CONCURRENCY = 4


def asks(n):
    return [GenRequest(({"role": "user", "content": f"Case {i}?\nA. yes\nB. no\nC. maybe"},)) for i in range(n)]


def dead_url():
    "The URL of a server that has stopped: every connection is refused"
    srv = MockServer().start()
    url = srv.base_url
    srv.stop()
    return url


def test_load_is_shared_across_endpoints():
    with MockServer(policy="hash", delay=0.02) as a, MockServer(policy="hash", delay=0.02) as b:
        backend = OpenAIBackend("mock-model", base_url=f"{a.base_url},{b.base_url}", concurrency=CONCURRENCY, backoff=0.01)
        out = dict(backend.generate(asks(60)))
        na, nb = len(a.completions()), len(b.completions())
        identity = backend.identity()                      # asks both what they serve: the same (no checkpoint reported)
    assert sorted(out) == list(range(60)) and {g.finish_reason for g in out.values()} == {"stop"}
    assert na + nb == 60                                   # each request answered once, no duplicates
    assert min(na, nb) >= 15, (na, nb)                     # both servers carry a real share
    assert identity["base_url"] == f"{a.base_url},{b.base_url}"


def test_dead_endpoint_leaves_rotation():
    with MockServer(policy="hash") as live:
        backend = OpenAIBackend("mock-model", base_url=f"{dead_url()},{live.base_url}", concurrency=CONCURRENCY, backoff=0.01)
        out = dict(backend.generate(asks(40)))
        answered = len(live.completions())
    assert {g.finish_reason for g in out.values()} == {"stop"}
    assert answered == 40


def test_failing_endpoint_leaves_rotation():
    "A server that answers 503 to everything: out of rotation after a few tries, not after 40 x 7"
    with MockServer(policy="hash") as live, MockServer(faults=lambda n, attempt, body: "503") as failing:
        backend = OpenAIBackend("mock-model", base_url=[failing.base_url, live.base_url], concurrency=CONCURRENCY, backoff=0.01)
        out = dict(backend.generate(asks(40)))
        tried_failing, answered = len(failing.completions()), len(live.completions())
    assert {g.finish_reason for g in out.values()} == {"stop"} and answered == 40
    assert tried_failing <= 2 * CONCURRENCY, tried_failing


def test_every_endpoint_down_fails_like_one_url():
    backend = OpenAIBackend("mock-model", base_url=f"{dead_url()},{dead_url()}", concurrency=2, max_retries=1, backoff=0.01)
    out = dict(backend.generate(asks(3)))
    assert {g.finish_reason for g in out.values()} == {"error"}
    assert all(g.error.startswith("APIConnectionError") for g in out.values())


@pytest.mark.parametrize("scoring", ["generate", "logprob"])
def test_results_identical_to_one_url(scoring):
    items = load_medmisbench()[:16]
    def predictions(urls):
        backend = OpenAIBackend("mock-model", base_url=",".join(urls), concurrency=CONCURRENCY)
        df = run_benchmark(items, backend, scoring=scoring, progress=False)
        return df.drop(columns=[c for c in ("latency_s", "prompt_id") if c in df])   # prompt_id hashes the identity, which names the URLs
    with MockServer(policy="context") as a, MockServer(policy="context") as b:
        one, two = predictions([a.base_url]), predictions([a.base_url, b.base_url])
        assert len(b.completions()) > 0
    pd.testing.assert_frame_equal(one, two)
