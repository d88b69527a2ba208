"""Byte progress of save and load: ``progress_callback`` reports during the write and the
read (``bytes_done`` / ``bytes_total``), and the tqdm bar on rank 0 (issue 33, item 9)."""

from __future__ import annotations

import time

import pytest
import torch

import dist_checkpointing as dc
import dist_checkpointing.runtime.progress as progress
from dist_checkpointing import ShardedTensor

from .conftest import get_pool

KEYS = 16
ROW = 65536  # float32: 256 KiB per item and rank, 4 MiB per rank


def _state(rank: int, world: int, fill: bool = True) -> dict:
    return {f"layer{i}.w": ShardedTensor.from_rank_offsets(
        f"layer{i}.w", torch.full((1, ROW), float(i * world + rank)) if fill else torch.zeros(1, ROW),
        (0, rank, world)) for i in range(KEYS)}


def _byte_events(events: list, phase: str) -> list:
    return [(e["bytes_done"], e["bytes_total"]) for e in events if e["phase"] == phase and "bytes_done" in e]


def _save_and_load(rank, world, ckpt, raising=False):
    progress.REPORT_INTERVAL = 0.0  # every item reported: deterministic counts
    try:
        events: list = []

        def callback(event):
            events.append(event)
            if raising:
                raise RuntimeError("broken callback")

        dc.save(_state(rank, world), ckpt, progress_callback=callback)
        saved = list(events)
        events.clear()
        loaded = dc.load(_state(rank, world, fill=False), ckpt, progress_callback=callback)
        for i in range(KEYS):
            assert torch.equal(loaded[f"layer{i}.w"], torch.full((1, ROW), float(i * world + rank)))
        return saved, list(events)
    finally:
        progress.REPORT_INTERVAL = 0.5


def _check(events: list, phase: str, phase_names: list) -> None:
    reports = _byte_events(events, phase)
    total = KEYS * ROW * 4
    assert len(reports) >= KEYS // 2, reports  # several intermediate reports
    assert all(t == total for _, t in reports)
    done = [d for d, _ in reports]
    assert done == sorted(done) and 0 < done[0] < total and done[-1] == total
    # the phase-end reports keep their keys and order
    ends = [e for e in events if "seconds" in e]
    assert [e["phase"] for e in ends] == phase_names
    assert all(set(e) == {"phase", "seconds", "bytes", "elapsed"} for e in ends)
    # byte reports come between the end of "plan" and the end of their phase
    kinds = ["end" if "seconds" in e else "bytes" for e in events]
    assert kinds[0] == "end" and kinds[-2:] == ["end", "end"] and set(kinds[1:-2]) == {"bytes"}


@pytest.mark.parametrize("world", [1, 2])
def test_save_and_load_report_bytes_as_they_go(world, tmp_path):
    for saved, loaded in get_pool(world).run(_save_and_load, str(tmp_path / "ckpt")):
        _check(saved, "write", ["plan", "write", "finalize"])
        _check(loaded, "read", ["plan", "read", "finalize"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_raising_callback_does_not_break_save_or_load(world, tmp_path):
    for saved, loaded in get_pool(world).run(_save_and_load, str(tmp_path / "ckpt"), True):
        _check(saved, "write", ["plan", "write", "finalize"])
        _check(loaded, "read", ["plan", "read", "finalize"])
    assert dc.check_is_distributed_checkpoint(tmp_path / "ckpt")


def _count_meters(monkeypatch) -> list:
    """The arguments of every ``ByteMeter`` made from now on (this process)."""
    made = []
    original = progress.ByteMeter.__init__

    def counting(self, *args, **kwargs):
        made.append(args)
        original(self, *args, **kwargs)

    monkeypatch.setattr(progress.ByteMeter, "__init__", counting)
    return made


def test_no_meter_without_a_callback_or_bar(tmp_path, monkeypatch, capsys):
    made = _count_meters(monkeypatch)
    dc.save(_state(0, 1), tmp_path / "a")
    dc.load(_state(0, 1, fill=False), tmp_path / "a")
    dc.save(_state(0, 1), tmp_path / "b", progress_bar=False)
    assert made == []
    assert capsys.readouterr().err == ""  # stderr is no terminal here: no bar by default
    dc.save(_state(0, 1), tmp_path / "c", progress_callback=lambda e: None)
    assert [a[1] for a in made] == ["write"]


def test_progress_bar_when_asked_for(tmp_path, capsys):
    dc.save(_state(0, 1), tmp_path / "a", progress_bar=True)
    err = capsys.readouterr().err
    assert "write" in err and "4.00M" in err, err
    dc.load(_state(0, 1, fill=False), tmp_path / "a", progress_bar=True)
    err = capsys.readouterr().err
    assert "read" in err and "4.00M" in err, err


def test_reports_are_rate_limited():
    reports = []
    meter = progress.ByteMeter(lambda *r: reports.append(r), "write", 1000, interval=0.2)
    start = time.monotonic()
    for _ in range(1000):
        meter.add(1)
    meter.finish()
    meter.finish()  # the final count is reported once
    assert len(reports) <= 1 + (time.monotonic() - start) / 0.2
    assert reports[-1] == ("write", 1000, 1000) and reports.count(("write", 1000, 1000)) == 1


def _async_save(rank: int, world: int, where: str, writer: str, fully_parallel: bool = False) -> list:
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # "fork": CPU state, forked writer; "worker": the persistent writer; "thread": memory://,
    # which no other process can open, written from a thread of this process
    strategy = TorchDistSaveShardedStrategy(async_snapshot="copy" if writer == "worker" else "auto")
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy)
    events: list = []
    queue = AsyncCallsQueue()
    progress.REPORT_INTERVAL = 0.0  # every item reported (by the meters of this process and its forks)
    try:
        request = dc.save(_state(rank, world), where, strategy, async_sharded_save=True,
                          progress_callback=events.append)
        returned = len(events)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        progress.REPORT_INTERVAL = 0.5
        queue.close()
    loaded = dc.load(_state(rank, world, fill=False), where)
    assert all(torch.equal(loaded[f"layer{i}.w"], torch.full((1, ROW), float(i * world + rank))) for i in range(KEYS))
    return [returned, events]


@pytest.mark.parametrize("writer,world,fully_parallel", [
    ("fork", 1, False), ("worker", 1, False), ("thread", 1, False), ("fork", 2, True), ("worker", 2, False)])
def test_async_save_reports_bytes_as_its_writer_writes(tmp_path, writer, world, fully_parallel):
    """After ``save`` returns, the background write's bytes reach the callback (from a
    thread of this process, whichever process writes), ending at the total."""
    where = f"memory://progress-{world}-{fully_parallel}" if writer == "thread" else str(tmp_path / "a")
    totals = []
    for returned, events in get_pool(world).run(_async_save, where, writer, fully_parallel):
        ends = [e["phase"] for e in events if "seconds" in e]
        assert ends == ["plan", "snapshot"] and returned == 2  # the phase ends, while save ran
        assert all(set(e) == {"phase", "bytes_done", "bytes_total", "elapsed"} for e in events[2:])
        reports = _byte_events(events, "write")
        totals.append(reports[-1][1])
        assert all(t == totals[-1] for _, t in reports) and reports[-1][0] == totals[-1] > 0
        assert [d for d, _ in reports] == sorted(d for d, _ in reports)
        if writer == "thread":  # this process's meter: every item
            assert len(reports) == KEYS, reports
    # each rank's own items; with the fully parallel wrapper, the main replicas spread over the ranks
    assert totals == [KEYS * ROW * 4] * world if not fully_parallel else sum(totals) == KEYS * ROW * 4 * world


def test_async_save_reports_nothing_without_a_callback(tmp_path, monkeypatch):
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    made = _count_meters(monkeypatch)
    queue = AsyncCallsQueue()
    try:
        for snapshot in ("copy", "auto"):
            queue.schedule_async_request(dc.save(_state(0, 1), tmp_path / snapshot,
                                                 TorchDistSaveShardedStrategy(async_snapshot=snapshot),
                                                 async_sharded_save=True))
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert made == []
