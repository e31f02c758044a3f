"""`specsuite serve --ray local --replicas 2` as its own process: a real local Ray cluster, two
replicas of the server app behind Ray Serve's proxy, each with its own smollm2-135m. Both answer,
with the key, the routes and the answers of one `specsuite serve` process; SIGTERM ends it all."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conftest import serve_process

if not os.environ.get("CI"):  # CI installs the extra: a missing Ray Serve is a failure there
    pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.real_model, pytest.mark.ray]

KEY = "replica-key"
SENTENCES = ["I has a dog.", "They was happy.", "She go home.", "We is here now.", "He like apples.",
             "The cats is sleeping.", "I goes to work.", "You was right."]


@pytest.fixture(scope="module")
def replicas(smollm2_fp32, tmp_path_factory):
    """(base URL, process); `smollm2_fp32` first: the model is on disk before the replicas load it.
    `--exact` (fp32 rows with a tie guard): replicas with one thread each answer as this process
    does; int8 batches may split near-ties otherwise (docs/exactness.md)."""
    log = tmp_path_factory.mktemp("ray_serve") / "serve.log"
    proc, url = serve_process(log, "--ray", "local", "--replicas", "2", "--replica-cpus", "1", "--api-key", KEY,
                              "--model", "smollm2-135m", "--dtype", "fp32", "--exact", "--no-ui", "--batch-size", "4",
                              "--drain-timeout", "20", timeout=300)
    try:
        # The proxy answers once one replica runs; the tests need both (Ray routes only to running ones).
        deadline = time.monotonic() + 240
        while len(replica_ids(url, 10)) < 2:
            assert time.monotonic() < deadline, "the second replica did not start"
            time.sleep(1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_replicas_answer_with_the_key_routes_and_answers_of_one_process(smollm2_fp32, replicas):
    from specsuite.apps.gec.corrector import Corrector

    url, _ = replicas
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=30,
                       json={"model": "specsuite-gec", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ready"  # open, for the load balancer

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert {m.id for m in client.models.list()} >= {"specsuite-gec", "smollm2-135m"}

    def correct(sentence: str) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model="specsuite-gec", messages=[{"role": "user", "content": sentence}])
        return raw.parse().choices[0].message.content, raw.headers["x-specsuite-replica"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(correct, SENTENCES * 3))
    corrector = Corrector.from_loaded(*smollm2_fp32, backend="exact")
    assert [text for text, _ in answers] == [corrector.correct(s).text for s in SENTENCES * 3]
    assert len({replica for _, replica in answers}) == 2  # both replicas answered

    stream = client.chat.completions.create(model="specsuite-gec", stream=True,
                                            messages=[{"role": "user", "content": SENTENCES[0]}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == corrector.correct(SENTENCES[0]).text


def replica_ids(url: str, tries: int = 40) -> set[str]:
    return {httpx.get(url + "/health", timeout=30).json()["replica"] for _ in range(tries)}


def replica_pids() -> list[int]:
    """The replicas' processes on this machine (Ray names them ray::ServeReplica:<app>:<class>)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"ServeReplica:specsuite" in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def test_a_replica_killed_under_load_is_replaced_and_its_callers_get_an_error_not_a_hang(smollm2_fp32, replicas):
    from specsuite.apps.gec.corrector import Corrector

    url, _ = replicas
    text = "\n".join(SENTENCES)
    expected = Corrector.from_loaded(*smollm2_fp32, backend="exact").correct(text).text
    before = replica_ids(url)
    assert len(before) == 2 and len(replica_pids()) == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def correct(_) -> str:
        try:
            return client.chat.completions.create(model="specsuite-gec", messages=[
                {"role": "user", "content": text}]).choices[0].message.content
        except openai.APIStatusError as e:  # the killed replica's callers
            return f"error {e.status_code}"

    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(correct, i) for i in range(8)]
        time.sleep(2)
        os.kill(replica_pids()[0], signal.SIGKILL)
        outcomes = [c.result(timeout=150) for c in calls]  # every call ends: answered or a clear error
    assert all(o == expected or o.startswith("error 5") for o in outcomes), outcomes
    deadline = time.monotonic() + 240
    while not replica_ids(url, 10) - before:  # a new replica took the dead one's place
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(2)
    reply = client.chat.completions.create(model="specsuite-gec", messages=[{"role": "user", "content": SENTENCES[0]}])
    assert reply.choices[0].message.content


def test_sigterm_stops_the_replicas_and_the_cluster(replicas):
    url, proc = replicas
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=5)
