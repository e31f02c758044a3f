"""The batch job on a real local Ray cluster (one node, 2 CPUs) with smollm2-135m: its output
equals the one-machine job's, also after an actor or the driver is killed mid-job."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specsuite.apps.jobs import runner as batch
from specsuite.apps.jobs.runner import run_batch
from specsuite.apps.gec.corrector import Corrector, correction_worker
from specsuite.apps.jobs.ray_jobs import BlockFailedError, count_lines, read_block, run_ray_batch, split_blocks

if os.environ.get("CI"):  # CI installs the extra: a missing Ray is a failure there
    import ray
else:
    ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.real_model, pytest.mark.ray]

MAX_NEW_TOKENS = 8  # short corrections keep the tests fast; truncation warnings get tested too
# Batch size 1 (`--exact`): token for token greedy, so the output must equal the one-machine job's
# byte for byte. The batched engine's output depends on which texts share a batch (near-ties), and
# a block is one batch: with it the tests check every line once, in order, with the same errors.
# fp32: on every CPU one-at-a-time decoding is then plain greedy decoding in both processes (in
# bf16 the backend, and so a near-tie, may differ between the reference's and the actors' loads).
SETTINGS = {"model": "smollm2-135m", "drafter": "copy", "dtype": "fp32", "max_new_tokens": MAX_NEW_TOKENS,
            "batch_size": 1}
BATCHED = {**SETTINGS, "batch_size": 8}
BLOCK_LINES = 5
SENTENCES = ["She go to school yesterday.", "He have two cat.", "I am agree with you.", "They was happy.",
             "We goes home now.", "The informations is useful.", "She don't like apples.",
             "Me and him went there.", "It are raining today.", "He can sings well.", "I has a dog.",
             "There is many books."]


def _input_lines() -> list[bytes]:
    """40 lines: short sentences and every kind of bad line (each an error record, never a failure)."""
    lines = [s.encode() for s in SENTENCES * 3]
    lines[5] = b""  # empty text
    lines[12] = b"caf\xe9 is good."  # invalid UTF-8
    lines[20] = " ".join(["word"] * 1100).encode()  # over the token limit
    lines[27] = lines[27] + b"\r"  # a CRLF line
    return lines + [b"One more line.", b"And the last one.", b"The end is here.", b"No newline at the end"]


@pytest.fixture(scope="module")
def input_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray_input") / "in.txt"
    path.write_bytes(b"\n".join(_input_lines()))
    return path


@pytest.fixture(scope="module")
def reference(smollm2_fp32, input_file, tmp_path_factory) -> dict[str, Path]:
    """The one-machine job's outputs (.txt with its sidecar, .jsonl) with the same model, dtype and backend
    (the commands' default, `fast`)."""
    out = tmp_path_factory.mktemp("ray_reference")
    corrector = Corrector.from_loaded(*smollm2_fp32, max_new_tokens=MAX_NEW_TOKENS, batch_size=1, backend="fast")
    paths = {suffix: out / f"ref{suffix}" for suffix in (".txt", ".jsonl")}
    for path in paths.values():
        run_batch(input_file, path, corrector.job_worker, progress=False)
    return paths


@pytest.fixture(scope="module")
def cluster(smollm2_fp32):
    """A one-node cluster on this machine with 2 CPUs, stopped at the end with every process it started.
    (Ray 2.x registers a local node under the machine's own IP even when asked for 127.0.0.1:
    `services.resolve_ip_for_localhost`; it is still this machine only.)
    (`smollm2_fp32` first: the model is on disk before the actors load it.)"""
    # address="local": a new cluster, never one that `ray start` left running on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor_pids: set[int] = set()
    try:
        yield actor_pids
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 30
    while (alive := {pid for pid in actor_pids if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"actor processes left running: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


_factory = functools.partial(correction_worker, **SETTINGS)  # pickled to the actors, as the CLI does (exact)


def _run(input_file: Path, output: Path, pids: set[int], on_block=None, settings=SETTINGS):
    def record(done):
        pids.add(done.pid)
        if on_block:
            on_block(done)

    return run_ray_batch(input_file, output, functools.partial(correction_worker, **settings), workers=2,
                         block_lines=BLOCK_LINES, progress=False, job_info=settings, on_block=record)


def _without_stats(path: Path) -> list[dict]:
    """JSONL records without their timings (the only part that differs between two runs)."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [{k: v for k, v in r.items() if k != "stats"} for r in records]


def _assert_same_txt(output: Path, reference: Path) -> None:
    assert output.read_bytes().split(b"\n") == reference.read_bytes().split(b"\n")  # line by line
    sidecar = ".errors.jsonl"
    assert Path(str(output) + sidecar).read_bytes() == Path(str(reference) + sidecar).read_bytes()
    assert not output.with_name(output.name + ".ray-parts").exists()


# ---- no cluster needed --------------------------------------------------------------------

def test_blocks_read_lines_as_the_one_machine_job_does(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbfbom line\r\n\nplain\n\xff bytes\r\nlast without newline")
    expected = list(batch._lines(path, skip=0))
    for size in (1, 2, 3, 10):
        blocks = split_blocks(path, size)
        assert sum(b.lines for b in blocks) == count_lines(path) == len(expected)
        assert [line for b in blocks for line in read_block(path, b)] == expected


# ---- on the cluster -----------------------------------------------------------------------

def test_ray_job_equals_the_one_machine_job(cluster, input_file, reference, tmp_path):
    output = tmp_path / "out.txt"
    summary = _run(input_file, output, cluster)
    _assert_same_txt(output, reference[".txt"])
    assert (summary.total, summary.errors, summary.skipped_resumed) == (40, 3, 0)
    assert summary.warnings == Path(str(output) + ".errors.jsonl").read_text().count('"warning"')
    # Rerunning a finished job starts nothing and says so.
    again = run_ray_batch(input_file, output, _factory, address="unused: nothing to do", progress=False)
    assert (again.total, again.errors, again.skipped_resumed) == (40, 3, 40)


def test_killing_an_actor_mid_job_redoes_its_block(cluster, input_file, reference, tmp_path):
    output = tmp_path / "out.jsonl"
    pids: list[int] = []

    def kill_the_first_actor_in_its_next_block(done):
        if not pids:  # it has just been given its next block: kill -9 it at once (a 0.3 s timer
            os.kill(done.pid, signal.SIGKILL)  # lost the race to a block that finished sooner)
        pids.append(done.pid)

    summary = _run(input_file, output, cluster, on_block=kill_the_first_actor_in_its_next_block, settings=BATCHED)
    assert len(set(pids)) == 3, "a replacement actor did the rest of the killed actor's work"
    assert pids.count(pids[0]) == 1
    records, expected = _without_stats(output), _without_stats(reference[".jsonl"])
    same = ("line", "source", "error", "input")  # every line once, in order, the same error records
    assert [{k: r.get(k) for k in same} for r in records] == [{k: r.get(k) for k in same} for r in expected]
    assert [sorted(r) for r in records] == [sorted(r) for r in expected]
    assert (summary.total, summary.errors) == (40, 3)


def test_a_block_failing_repeatedly_ends_the_job_naming_it_and_done_stays_done(
        cluster, input_file, reference, tmp_path):
    moved = tmp_path / "moved.txt"
    output = tmp_path / "out.txt"

    def take_the_input_away(done):  # every read fails from now on: a block fails on every actor
        if not moved.exists():
            input_file.rename(moved)

    try:
        with pytest.raises(BlockFailedError, match=r"block \d+ \(lines \d+-\d+\) failed 3 times, last: "
                                                   r"FileNotFoundError"):
            _run(input_file, output, cluster, on_block=take_the_input_away)
    finally:
        moved.rename(input_file)
    committed = sorted(output.with_name("out.txt.ray-parts").glob("*.done"))
    assert committed and not output.exists()
    summary = _run(input_file, output, cluster)
    assert summary.skipped_resumed == BLOCK_LINES * len(committed)
    _assert_same_txt(output, reference[".txt"])


def test_killing_the_driver_and_rerunning_gives_the_same_output(cluster, input_file, reference, tmp_path):
    output = tmp_path / "out.txt"
    parts = output.with_name("out.txt.ray-parts")
    command = [sys.executable, "-m", "specsuite.cli", "gec", "correct", str(input_file), "-o", str(output),
               "--ray", ray.get_runtime_context().gcs_address, "--workers", "2",
               "--block-lines", str(BLOCK_LINES), "--model", "smollm2-135m", "--max-new-tokens", str(MAX_NEW_TOKENS),
               "--batch-size", "1", "--dtype", "fp32"]  # one text at a time, as the reference (--exact would also change the backend)
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while len(list(parts.glob("*.done"))) < 2 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.poll() is None, f"the driver ended before it was killed: {driver.stderr.read().decode()}"
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    done_before = len(list(parts.glob("*.done")))
    assert 2 <= done_before < 8 and not output.exists()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 1, rerun.stderr  # 1: some lines are error records
    assert f"({done_before * BLOCK_LINES} from an earlier run)" in rerun.stdout
    _assert_same_txt(output, reference[".txt"])
