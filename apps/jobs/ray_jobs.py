"""The batch correction job on a Ray cluster: the one-machine job's output, from an actor pool.

The input (a path every node can read, e.g. shared storage) is split into blocks of consecutive
lines, found by byte offset. A pool of Ray actors, each holding one loaded model, corrects the
blocks with `runner.process_lines`, the one-machine job's unit of work, so records and error
records are the same. The driver commits each finished block as a part file under
`OUTPUT.ray-parts/` (written with the one-machine job's writers, fsync'ed, then renamed) and, when
every block is committed, concatenates the parts in line order into OUTPUT (and, for a `.txt`
output, the `.errors.jsonl` sidecar), then removes the parts.

Resuming: rerunning the same command after a crash of the driver, an actor or a node redoes only
the blocks without a committed part file. An actor that dies is replaced and its block retried;
a block that fails `max_attempts` times ends the job with `BlockFailedError` naming the block
(committed blocks stay done). Ray's own task retries are off, so that every failure is counted here.

Why plain Ray actors and not Ray Data's `map_batches`: Ray Data retries failed actor tasks on its
own terms, so a block that keeps killing its actor could neither be counted nor named, and its
progress bars count rows per operator, not lines done and errors. A driver loop over a few actors
gives those guarantees in a few dozen lines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .runner import (BatchSummary, JobWorker, JsonlWriter, ResumeError, TextWriter, count_lines, input_format,
                     process_lines, strip_line)

# The default block size: about BLOCKS_PER_WORKER equal blocks per actor, so that the last ones
# balance out, but at least MIN_BLOCK_LINES lines (twice the batched engine's default batch: a block
# is one continuous batch, which drains at its end) and at most MAX_BLOCK_LINES (a finished block
# shows on the progress bar and survives a crash).
BLOCKS_PER_WORKER, MIN_BLOCK_LINES, MAX_BLOCK_LINES = 4, 64, 256
PARTS_SUFFIX = ".ray-parts"
DONE, SIDECAR, TMP = ".done", ".errors.jsonl", ".tmp"


class BlockFailedError(RuntimeError):
    """A block failed `max_attempts` times; the blocks committed so far stay done."""


@dataclass(frozen=True)
class Block:
    """Consecutive input lines: numbers first_line.., bytes [start, end) of the input."""

    index: int
    first_line: int
    lines: int
    start: int
    end: int

    def __str__(self) -> str:
        return f"block {self.index} (lines {self.first_line}-{self.first_line + self.lines - 1})"


@dataclass(frozen=True)
class BlockDone:
    """What the driver learns when a block is committed (passed to `on_block`)."""

    block: Block
    pid: int  # the actor's process
    errors: int


# ---- the input ---------------------------------------------------------------------------

def split_blocks(path: Path, block_lines: int) -> list[Block]:
    """The input's blocks of `block_lines` lines (the last one shorter)."""
    blocks: list[Block] = []
    start = offset = lines = 0
    with open(path, "rb") as f:
        for raw in f:  # binary mode splits on b"\n" only, as the one-machine job does
            offset += len(raw)
            lines += 1
            if lines == block_lines:
                blocks.append(Block(len(blocks), 1 + len(blocks) * block_lines, lines, start, offset))
                start, lines = offset, 0
    if lines:
        blocks.append(Block(len(blocks), 1 + len(blocks) * block_lines, lines, start, offset))
    return blocks


def default_block_lines(total: int, workers: int) -> int:
    """Equal blocks, up to BLOCKS_PER_WORKER per actor, of MIN_BLOCK_LINES..MAX_BLOCK_LINES lines
    where the input allows (200 lines, 2 actors: 2 blocks of 100)."""
    per_worker = max(1, min(BLOCKS_PER_WORKER, total // (workers * MIN_BLOCK_LINES)))
    return max(1, min(MAX_BLOCK_LINES, -(-total // (workers * per_worker))))


def read_block(path: str | Path, block: Block) -> Iterator[tuple[int, bytes]]:
    """(number, raw line without its line break) of a block's lines, as the one-machine job reads them."""
    with open(path, "rb") as f:
        f.seek(block.start)
        data = f.read(block.end - block.start)
    if len(data) != block.end - block.start:
        raise OSError(f"{path} is shorter than when the job started: it changed under the job")
    for number, raw in enumerate(data.split(b"\n")[: block.lines], block.first_line):
        yield number, strip_line(number, raw)


# ---- the actor ---------------------------------------------------------------------------

class BlockWorker:
    """A Ray actor: loads the model once, then processes blocks of the input."""

    def __init__(self, worker_factory: Callable[[], JobWorker], threads: int) -> None:
        import torch

        torch.set_num_threads(threads)  # the CPUs Ray reserved for this actor, no more
        self.worker = worker_factory()

    def process(self, path: str, block: Block, fmt: str, field: str,
                max_tokens: int | None) -> tuple[int, list[tuple[dict, str | bytes]]]:
        """(this process's pid, (record, .txt fallback) of each line of the block)."""
        limit = max_tokens if max_tokens is not None else self.worker.max_tokens
        return os.getpid(), list(process_lines(read_block(path, block), fmt, field, self.worker, limit))


# ---- part files and the output -----------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames in it are durable
    finally:
        os.close(fd)


class Parts:
    """The committed blocks of a job: `NNNNNN.done` (+ `NNNNNN.errors.jsonl` for a `.txt` output)."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.dir = output.with_name(output.name + PARTS_SUFFIX)
        self.text = output.suffix == ".txt"  # as the one-machine job chooses its writer

    def main(self, index: int, suffix: str = DONE) -> Path:
        return self.dir / f"{index:06d}{suffix}"

    def sidecar(self, index: int, suffix: str = DONE) -> Path:
        return self.dir / f"{index:06d}{suffix if suffix == TMP else ''}{SIDECAR}"

    def committed(self, index: int) -> bool:
        return self.main(index).exists()

    def commit(self, index: int, pairs: list[tuple[dict, str | bytes]]) -> None:
        """Write a block's records as the one-machine job would, then rename: the `.done` file is
        the commit, so a crash at any point leaves the block either committed whole or not at all."""
        tmp, tmp_sidecar = self.main(index, TMP), self.sidecar(index, TMP)
        for path in (tmp, tmp_sidecar):  # left by a crash: the writers append
            path.unlink(missing_ok=True)
        with TextWriter(tmp) if self.text else JsonlWriter(tmp) as writer:
            for record, fallback in pairs:
                writer.write(record, fallback)  # fsync'ed by the writer
        if tmp_sidecar.exists():
            os.replace(tmp_sidecar, self.sidecar(index))
        os.replace(tmp, self.main(index))
        _fsync_dir(self.dir)

    def counts(self, index: int) -> tuple[int, int, int]:
        """(lines, errors, warnings) of a committed block."""
        return _counts(self.main(index), self.sidecar(index) if self.text else None)

    def merge(self, blocks: list[Block]) -> None:
        """Concatenate the parts in line order into the output (sidecar first, as the one-machine
        job writes it first), each written whole and renamed into place."""
        if self.text:
            sidecars = [p for b in blocks if (p := self.sidecar(b.index)).exists()]
            sidecar = self.output.with_name(self.output.name + SIDECAR)
            if sidecars:
                _concat(sidecars, sidecar)
            else:  # a clean job leaves no sidecar
                sidecar.unlink(missing_ok=True)
        _concat([self.main(b.index) for b in blocks], self.output)


def _counts(main: Path, sidecar: Path | None) -> tuple[int, int, int]:
    """(lines, errors, warnings) of an output in the one-machine job's format."""
    if sidecar is None:  # JSONL records
        records = [json.loads(line) for line in main.read_bytes().split(b"\n") if line]
        errors = sum(r.get("error") is not None for r in records)  # OpenAI Batch lines have "error": null
        return len(records), errors, sum(bool(r.get("truncated")) for r in records if r.get("error") is None)
    notes = [json.loads(line) for line in sidecar.read_bytes().split(b"\n") if line] if sidecar.exists() else []
    return (main.read_bytes().count(b"\n"), sum("error" in r for r in notes),
            sum("warning" in r for r in notes))


def _concat(sources: list[Path], target: Path) -> None:
    tmp = target.with_name(target.name + TMP)
    with open(tmp, "wb") as out:
        for source in sources:
            with open(source, "rb") as f:
                shutil.copyfileobj(f, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)


# ---- the job ------------------------------------------------------------------------------

def _job_file(parts: Parts, job: dict) -> int:
    """Record the job in its parts directory, or check a rerun is the same job; its block size."""
    path = parts.dir / "job.json"
    if path.exists():
        before = json.loads(path.read_text(encoding="utf-8"))
        changed = [key for key in job if key != "block_lines" and before.get(key) != job[key]]
        if changed:
            raise ResumeError(f"{parts.dir} holds blocks of another job (it differs in {', '.join(changed)}): "
                              f"rerun that job, or delete {parts.dir} to start over")
        return int(before["block_lines"])
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(job, indent=1))
        f.flush()
        os.fsync(f.fileno())  # durable before any part that depends on its block size
    os.replace(tmp, path)
    _fsync_dir(parts.dir)
    return int(job["block_lines"])


def _lock(parts: Parts):
    """An exclusive lock on the parts directory while a driver runs (released when the file closes)."""
    import fcntl

    f = open(parts.dir / "lock", "ab")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"another driver is running this job ({parts.dir} is locked)") from None
    return f


def _short(error: BaseException) -> str:
    """A one-line reason: the exception raised in the actor, or why the actor died."""
    cause = getattr(error, "cause", None)  # RayTaskError: the actor's own exception
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    if getattr(error, "actor_init_failed", False) and lines:  # the message ends with the exception raised
        return f"the actor failed to start: {lines[-1].strip()}"
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _connect(address: str) -> bool:
    """Join (or, for "local", start) a Ray cluster; True if this call started the connection."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("Ray is not installed: pip install -e '.[ray]'") from None
    if ray.is_initialized():
        return False
    # log_to_driver=False: the actors' model-loading chatter would break the progress bar;
    # their failures reach the driver as exceptions.
    if address == "local":
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def run_ray_batch(
    input_path: str | Path,
    output_path: str | Path,
    worker_factory: Callable[[], JobWorker],
    *,
    address: str = "local",
    workers: int = 2,
    threads_per_worker: int = 1,
    fmt: str | None = None,
    field: str = "text",
    max_tokens: int | None = None,
    block_lines: int | None = None,
    max_attempts: int = 3,
    progress: bool = True,
    job_info: dict[str, Any] | None = None,
    on_block: Callable[[BlockDone], None] | None = None,
) -> BatchSummary:
    """Process every line of `input_path` into `output_path` on a Ray cluster, resuming a previous run.

    `address`: "local" starts an in-process cluster, "auto" or "HOST:PORT" joins one started with
    `ray start` (an already initialised Ray connection is used as is). `worker_factory` runs in
    each actor (picklable: e.g. `functools.partial(correction_worker, model="qwen2.5-0.5b")`). `block_lines`
    defaults to `default_block_lines` and is kept from the first run on resume.
    `job_info` (e.g. the model settings) is recorded, and a rerun with other settings is refused.
    The output, records and sidecar, is byte for byte what `run_batch` writes for the same corrections
    (with the batched engine, a block is one batch: on near-ties a line can differ from the one-machine
    job's, as between two batch sizes; with batch size 1, `--exact`, it is the same).
    """
    if workers < 1 or threads_per_worker < 1 or max_attempts < 1:
        raise ValueError("workers, threads_per_worker and max_attempts must be >= 1")
    input_path, output_path = Path(input_path).resolve(), Path(output_path).resolve()
    fmt = input_format(input_path, fmt)
    if output_path == input_path:
        raise ValueError("the output path is the input path")
    parts = Parts(output_path)
    total = count_lines(input_path)
    if output_path.exists() and not parts.dir.exists():
        try:
            lines, errors, warnings = _counts(output_path, output_path.with_name(output_path.name + SIDECAR)
                                              if parts.text else None)
        except ValueError:  # a partial last record: not a finished output
            lines = errors = warnings = -1
        if lines == total:  # a finished job (Ray or one-machine): nothing to redo
            return BatchSummary(total, total - errors, errors, total, warnings)
        raise ResumeError(f"{output_path} exists but is not a finished output and has no {parts.dir}: "
                          "finish it without --ray, or delete it")
    parts.dir.mkdir(parents=True, exist_ok=True)
    with _lock(parts):
        stat = input_path.stat()
        block_lines = _job_file(parts, {
            "input": str(input_path), "input_bytes": stat.st_size, "input_mtime_ns": stat.st_mtime_ns,
            "lines": total, "format": fmt, "field": field, "max_tokens": max_tokens,
            "output": output_path.suffix, **(job_info or {}),
            "block_lines": block_lines or default_block_lines(total, workers),
        })
        blocks = split_blocks(input_path, block_lines)
        done = [b for b in blocks if parts.committed(b.index)]
        resumed = sum(b.lines for b in done)
        errors = warnings = 0
        for b in done:
            _, e, w = parts.counts(b.index)
            errors, warnings = errors + e, warnings + w
        todo = [b for b in blocks if not parts.committed(b.index)]
        if todo:
            job = _Job(str(input_path), fmt, field, max_tokens, worker_factory, threads_per_worker, parts)
            with tqdm(total=total, initial=resumed, unit="line", disable=not progress, dynamic_ncols=True) as bar:
                bar.set_postfix(errors=errors, refresh=False)
                e, w = _run_blocks(job, todo, address, workers, max_attempts, bar, errors, on_block)
            errors, warnings = errors + e, warnings + w
        parts.merge(blocks)
        shutil.rmtree(parts.dir)  # the lock file goes with it; the open handle still holds the lock
    return BatchSummary(total, total - errors, errors, resumed, warnings)


@dataclass(frozen=True)
class _Job:
    """What every block of a job is corrected with."""

    path: str
    fmt: str
    field: str
    max_tokens: int | None
    worker_factory: Callable[[], JobWorker]
    threads: int
    parts: Parts


def _run_blocks(job: _Job, todo: list[Block], address: str, workers: int, max_attempts: int, bar: tqdm,
                errors_before: int, on_block: Callable[[BlockDone], None] | None) -> tuple[int, int]:
    """Process and commit `todo` with a pool of actors; (errors, warnings) of these blocks."""
    started = _connect(address)
    import ray
    from ray.exceptions import RayError, RayTaskError

    cpus = ray.cluster_resources().get("CPU", 0)
    if workers * job.threads > cpus:
        print(f"warning: {workers} workers x {job.threads} threads need {workers * job.threads} CPUs, the "
              f"cluster has {cpus:g}: some actors wait for CPUs", file=sys.stderr)
    # max_restarts=0, max_task_retries=0: a dead actor is replaced here, and its block's failure counted.
    actor_class = ray.remote(BlockWorker).options(num_cpus=job.threads, max_restarts=0, max_task_retries=0)
    actors: list[Any] = []  # every actor started, to stop them all at the end

    def new_actor() -> Any:
        actors.append(actor_class.remote(job.worker_factory, job.threads))
        return actors[-1]

    try:
        idle = [new_actor() for _ in range(min(workers, len(todo)))]
        queue, running = deque(todo), {}
        attempts: Counter[int] = Counter()
        errors = warnings = restarts = 0
        while queue or running:
            while idle and queue:
                actor, block = idle.pop(), queue.popleft()
                running[actor.process.remote(job.path, block, job.fmt, job.field, job.max_tokens)] = (actor, block)
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, block = running.pop(ref)
            try:
                pid, pairs = ray.get(ref)
            except RayError as error:
                attempts[block.index] += 1
                if not isinstance(error, RayTaskError):  # the actor's process or node is gone
                    ray.kill(actor)
                    actor, restarts = new_actor(), restarts + 1
                if attempts[block.index] >= max_attempts:
                    raise BlockFailedError(
                        f"{block} failed {max_attempts} times, last: {_short(error)}. The blocks committed "
                        f"in {job.parts.dir} stay done: rerun the same command to redo only the others") from error
                queue.appendleft(block)  # retried first, by the next idle actor
                idle.append(actor)
            else:
                job.parts.commit(block.index, pairs)
                block_errors = sum(r.get("error") is not None for r, _ in pairs)
                errors += block_errors
                warnings += sum(bool(r.get("truncated")) for r, _ in pairs if r.get("error") is None)
                bar.update(block.lines)
                if on_block:
                    on_block(BlockDone(block, pid, block_errors))
                idle.append(actor)
            bar.set_postfix({"errors": errors_before + errors, **({"restarts": restarts} if restarts else {})})
        return errors, warnings
    finally:
        for actor in actors:
            ray.kill(actor)  # free their CPUs and memory now, also after a failure
        if started:
            ray.shutdown()
