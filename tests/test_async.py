"""Producers in async code: awaited fan-outs, sweeps and studies, watched progress, cancellation both ways.

Against the session fleet (real redis-server, real workers); every wait listens on Redis
pub/sub through one ``redis.asyncio`` connection per client.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

import tasks
from tasks import FanOutTimeout, FleetClient, Report

from .conftest import producer_connections, wait_for

pytestmark = pytest.mark.timeout(120)

DEVICES = ["cpu0", "cpu1"]


def test_fifty_concurrent_awaited_fan_outs_from_one_event_loop(fleet, app):
    threads_before = threading.active_count()

    async def main() -> tuple[list[dict], int, int]:
        async with FleetClient(app) as client:
            handles = [client.fan_out("echo", DEVICES, kwargs={"value": i}) for i in range(50)]
            results = await asyncio.gather(*(handle.wait(timeout=90) for handle in handles))
            listener = client.listener()
            return results, threading.active_count(), len(listener._subscribed)

    results, threads_during, still_subscribed = asyncio.run(main())
    assert len(results) == 50
    for i, result in enumerate(results):
        assert list(result) == DEVICES
        assert {d: (e["status"], e["output"]["value"], e["device"]) for d, e in result.items()} == \
            {d: ("ok", i, d) for d in DEVICES}
    # One event loop, no thread per wait; every subscription given back.
    assert threads_during <= threads_before + 2, (threads_before, threads_during)
    assert still_subscribed == 0


def test_await_handle_equals_get_and_both_apis_share_one_handle(fleet, app):
    handle = tasks.fan_out("echo", DEVICES, kwargs={"value": "same"}, app=app)

    async def main() -> tuple[dict, dict, tasks.Summary]:
        result = await handle
        return result, await handle.astates(), await handle.asummary()

    awaited, states, summary = asyncio.run(main())
    assert awaited == handle.get(timeout=30)
    assert states == handle.states() == {"cpu0": "SUCCESS", "cpu1": "SUCCESS"}
    assert (summary.total, summary.done, summary.running, summary.queued) == (2, 2, 0, 0)
    assert summary == handle.summary()


def test_a_new_client_s_first_watch_and_wait_log_no_warning(fleet, app, caplog):
    """The first awaited use of a client's listener: a watch subscribes to no job at first
    (its reader must not start before a SUBSCRIBE has given it a connection to read)."""

    async def main() -> tuple[list[str], dict]:
        async with FleetClient(app) as client:
            handle = client.fan_out("echo", DEVICES, kwargs={"value": "first"})
            finals = [report.key async for report in handle.watch() if report.finished]
            return finals, await handle.wait(timeout=60)

    with caplog.at_level("WARNING", logger="tasks.producer"):
        finals, result = asyncio.run(main())
    assert sorted(finals) == DEVICES and {d: e["status"] for d, e in result.items()} == dict.fromkeys(DEVICES, "ok")
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []


def test_progress_arrives_in_order_and_the_last_report_before_the_result(fleet, app, tmp_path):
    steps = 6

    async def main() -> tuple[list[Report], dict]:
        async with FleetClient(app) as client:
            # 0.3 s a step: longer than the job process's throttle, so every report goes out.
            handle = client.fan_out("counted", DEVICES, kwargs={"marker": str(tmp_path), "seconds": 0.3 * steps,
                                                                  "steps": steps, "score": 0.5})
            reports = [report async for report in handle.watch()]
            return reports, await handle.wait(timeout=60)

    reports, result = asyncio.run(main())
    for device in DEVICES:
        mine = [r for r in reports if r.key == device]
        seen = [r.progress["step"] for r in mine if r.state == "PROGRESS"]
        assert seen == sorted(set(seen)), seen  # in order, none twice
        assert seen[-1] == steps and len(seen) >= steps - 1, seen
        assert mine[-1].state == "SUCCESS" and mine[-1].finished
        assert mine[-1].progress["step"] == steps  # the last report came before the result
        assert mine[-1].entry == result[device]
        assert [r.state for r in mine].index("SUCCESS") == len(mine) - 1
    assert {e["status"] for e in result.values()} == {"ok"}


def test_an_awaited_sweep_and_its_watch(fleet, app, tmp_path):
    trials = tasks.grid({"score": [0.1, 0.2, 0.3, 0.4, 0.5], "steps": [2]})

    async def main() -> tuple[list[Report], list[dict], list[str]]:
        async with FleetClient(app) as client:
            handle = client.sweep("counted", trials, DEVICES, kwargs={"marker": str(tmp_path), "seconds": 0.2},
                                  max_concurrent=2)
            reports = [report async for report in handle.watch()]
            return reports, await handle, handle.states()

    reports, entries, states = asyncio.run(main())
    assert [e["trial"] for e in entries] == [0, 1, 2, 3, 4]
    assert [e["output"]["score"] for e in entries] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert states == ["SUCCESS"] * 5
    # max_concurrent=2: the watch fed the sweep as trials finished; each trial ended once, in its report.
    finals = [r for r in reports if r.finished]
    assert sorted(r.key for r in finals) == [0, 1, 2, 3, 4]
    assert {r.key: r.entry["output"]["score"] for r in finals} == {i: (i + 1) / 10 for i in range(5)}


def _running(reports: list[Report], want: int) -> bool:
    return len({r.key for r in reports if r.state == "PROGRESS"}) >= want


async def _cancel_while_running(handle: tasks.FanOut, *, cancel: bool) -> None:
    """Await ``handle`` in a task, and cancel that task once every device reported progress."""
    waiter = asyncio.create_task(handle.wait(cancel=cancel))
    seen: list[Report] = []
    async for report in handle.watch():
        seen.append(report)
        if _running(seen, len(handle.devices)):
            break
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


def test_cancelling_the_awaiting_task_leaves_the_jobs_running(fleet, app, tmp_path):
    async def main() -> tuple[dict[str, str], dict]:
        async with FleetClient(app) as client:
            handle = client.fan_out("counted", DEVICES, kwargs={"marker": str(tmp_path), "seconds": 2.0,
                                                                  "steps": 10})
            await _cancel_while_running(handle, cancel=False)
            states = await handle.astates()
            return states, await handle.wait(timeout=60)

    states, result = asyncio.run(main())
    assert set(states.values()) <= {"STARTED", "PROGRESS"}, states  # not revoked
    assert {d: e["status"] for d, e in result.items()} == {"cpu0": "ok", "cpu1": "ok"}


def test_wait_with_cancel_cancels_the_jobs_with_the_task(fleet, app, tmp_path):
    async def main() -> dict:
        async with FleetClient(app) as client:
            handle = client.fan_out("counted", DEVICES, kwargs={"marker": str(tmp_path), "seconds": 30.0,
                                                                  "steps": 150})
            await _cancel_while_running(handle, cancel=True)
            return await handle.wait(timeout=60)

    result = asyncio.run(main())
    assert {d: e["status"] for d, e in result.items()} == {"cpu0": "cancelled", "cpu1": "cancelled"}


def test_wait_times_out_naming_the_pending_devices_and_the_jobs_go_on(fleet, app, tmp_path):
    release = tmp_path / "release"

    async def main() -> tuple[FanOutTimeout, dict]:
        async with FleetClient(app) as client:
            handle = client.fan_out("hold", ["cpu1"], kwargs={"release_file": str(release), "steps": 1})
            with pytest.raises(FanOutTimeout) as caught:
                await handle.wait(timeout=0.5)
            release.touch()
            return caught.value, await handle.wait(timeout=60)

    error, result = asyncio.run(main())
    assert "cpu1" in str(error)
    assert result["cpu1"]["status"] == "ok"


def test_a_client_owns_its_connections_and_closes_them(fleet, app):
    before = producer_connections(fleet.redis_url)

    async def main() -> tuple[dict, int]:
        async with FleetClient(app) as client:
            result = await client.fan_out("echo", ["cpu0"], kwargs={"value": 1}).wait(timeout=30)
            assert "cpu0" in client.live_devices()
            return result, producer_connections(fleet.redis_url)

    result, during = asyncio.run(main())
    assert result["cpu0"]["output"]["value"] == 1
    assert during >= before + 3, (before, during)  # the blocking client, the asyncio one, its pub/sub
    # Redis lists a closed connection until it has read the close.
    wait_for(lambda: producer_connections(fleet.redis_url) == before, 10, "the producer connections to close")


def test_an_apps_default_connections_close_with_it_and_never_keep_it_alive(fleet, tmp_path):
    """``tasks.live_devices(app=...)`` opens the app's default connections (a producer's
    registry client); ``app.close()`` closes them, and an app nobody holds any more is collected
    (they used to keep it alive, and open, until the interpreter exited)."""
    import gc
    import weakref

    from tasks.core.app import create_app
    from tasks.core.settings import Settings

    before = producer_connections(fleet.redis_url)
    closed = create_app(Settings.load(redis_url=fleet.redis_url, state_dir=tmp_path / "closed"))
    assert "cpu0" in tasks.live_devices(closed)
    assert producer_connections(fleet.redis_url) == before + 1
    closed.close()
    # Redis lists a closed connection until it has read the close.
    wait_for(lambda: producer_connections(fleet.redis_url) == before, 10, "the producer connections to close")
    dropped = create_app(Settings.load(redis_url=fleet.redis_url, state_dir=tmp_path / "dropped"))
    assert "cpu0" in tasks.live_devices(dropped)
    gone = weakref.ref(dropped)
    create_app(Settings.load(redis_url=fleet.redis_url, state_dir=tmp_path / "current"))  # Celery's current app now
    del dropped
    gc.collect()
    assert gone() is None, "its default connections kept the app alive"
    # Redis lists a closed connection until it has read the close.
    wait_for(lambda: producer_connections(fleet.redis_url) == before, 10, "the producer connections to close")


def test_one_client_serves_one_event_loop_after_another(fleet, app):
    with FleetClient(app) as client:
        first = asyncio.run(client.fan_out("echo", ["cpu0"], kwargs={"value": 1}).wait(timeout=30))
        second = asyncio.run(client.fan_out("echo", ["cpu0"], kwargs={"value": 2}).wait(timeout=30))
    assert (first["cpu0"]["output"]["value"], second["cpu0"]["output"]["value"]) == (1, 2)


def test_optimize_async_awaits_a_study_and_cancel_stops_it(fleet, app, tmp_path):
    optuna = pytest.importorskip("optuna")
    from tasks.producer.optimize import journal_storage

    async def main() -> tuple[object, int]:
        study = await tasks.optimize_async(
            "counted", {"score": [0.2, 0.7]}, 2, "score", name="awaited-study", app=app,
            kwargs={"marker": str(tmp_path), "seconds": 0.1},
            sampler=optuna.samplers.GridSampler({"score": [0.2, 0.7]}, seed=0))
        loop = asyncio.get_running_loop()
        running = asyncio.Event()

        def on_update(progress: object) -> None:  # from the study's thread
            if any(getattr(progress, "running", {}).values()):
                loop.call_soon_threadsafe(running.set)

        stopped = asyncio.create_task(tasks.optimize_async(
            "counted", {"score": [0.5]}, 4, "score", name="stopped-study", app=app, cancel=True,
            kwargs={"marker": str(tmp_path), "seconds": 60.0, "steps": 300}, on_update=on_update))
        await running.wait()
        stopped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopped
        return study, 0

    study, _ = asyncio.run(main())
    assert sorted(t.value for t in study.trials) == [0.2, 0.7]  # type: ignore[attr-defined]
    storage = journal_storage(app)

    def all_ended() -> list:
        trials = optuna.load_study(study_name="stopped-study", storage=storage).trials
        return trials if trials and all(t.state.is_finished() for t in trials) else []

    trials = wait_for(all_ended, 60, "the stopped study's trials to end")
    assert {t.state for t in trials} == {optuna.trial.TrialState.FAIL}
    assert all("cancelled" in t.user_attrs for t in trials)


def _study_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_running_study_is_a_handle_watched_counted_and_awaited(fleet, app, tmp_path):
    optuna = pytest.importorskip("optuna")
    scores = [0.1, 0.2, 0.3, 0.4]
    steps: list[int] = []  # on_update calls: one per step of the study's loop

    async def main() -> tuple[tasks.Summary, list[Report], object, tasks.Summary, dict[int, str]]:
        async with FleetClient(app) as client:
            handle = await asyncio.to_thread(
                client.start_study, "counted", {"score": scores}, 4, "score", devices=DEVICES,
                name=_study_name("watched"), max_concurrent=2, on_update=lambda p: steps.append(p.finished),
                kwargs={"marker": str(tmp_path), "seconds": 0.6, "steps": 3},
                sampler=optuna.samplers.GridSampler({"score": scores}, seed=0))
            assert isinstance(handle, tasks.StudyHandle)
            first = await handle.asummary()
            reports = [report async for report in handle.watch()]
            study = await handle.wait(timeout=60)
            return first, reports, study, await handle.asummary(), await handle.astates()

    first, reports, study, summary, states = asyncio.run(main())
    # Two trials sent (max_concurrent), two not asked for yet: queued.
    assert (first.total, first.done, first.running + first.queued) == (4, 0, 4), first
    # Every trial watched, including those asked for while watching; each one's reports in order.
    assert sorted({r.key for r in reports}) == [0, 1, 2, 3]
    for key in range(4):
        mine = [r for r in reports if r.key == key]
        seen = [r.progress["step"] for r in mine if r.state == "PROGRESS"]
        assert seen == sorted(set(seen)) and seen[-1] == 3, seen
        assert mine[-1].state == "SUCCESS" and mine[-1].progress["step"] == 3
        assert [r.state for r in mine].index("SUCCESS") == len(mine) - 1
        assert mine[-1].entry is not None and mine[-1].entry["status"] == "ok"
    trials = study.trials  # type: ignore[attr-defined]
    assert len(trials) == 4 and {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}
    assert sorted(t.value for t in trials) == scores
    assert all(sorted(t.intermediate_values) == [1, 2, 3] for t in trials)
    assert {t.number: t.value for t in trials} == {r.key: r.entry["output"]["score"] for r in reports if r.finished}
    assert (summary.total, summary.done, summary.running, summary.queued) == (4, 4, 0, 0)
    assert states == dict.fromkeys(range(4), "SUCCESS")
    # Woken by the trials' states, not a poll: no more steps than reports heard (and the first).
    assert 0 < len(steps) <= len(reports) + 1, (len(steps), len(reports))


def test_acancel_cancels_a_running_study_s_trials(fleet, app, tmp_path):
    optuna = pytest.importorskip("optuna")

    async def main() -> tuple[object, dict[int, str], tasks.Summary]:
        async with FleetClient(app) as client:
            handle = await asyncio.to_thread(
                client.start_study, "counted", {"score": [0.5]}, 6, "score", devices=DEVICES,
                name=_study_name("cancelled"), max_concurrent=2,
                kwargs={"marker": str(tmp_path), "seconds": 60.0, "steps": 300})
            seen: list[Report] = []
            async for report in handle.watch():
                seen.append(report)
                if _running(seen, 2):
                    break
            await handle.acancel()
            study = await handle.wait(timeout=60)
            return study, await handle.astates(), await handle.asummary()

    study, states, summary = asyncio.run(main())
    assert states == {0: "REVOKED", 1: "REVOKED"}  # no trial asked for after the cancel
    assert (summary.total, summary.cancelled, summary.running, summary.queued) == (2, 2, 0, 0)
    trials = study.trials  # type: ignore[attr-defined]
    assert len(trials) == 2 and {t.state for t in trials} == {optuna.trial.TrialState.FAIL}
    assert all("cancelled" in t.user_attrs for t in trials)
