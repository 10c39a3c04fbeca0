"""EngineBusy: busy time is the union of request intervals minus pauses, measured on a fake clock."""

import pytest

from stages.engine_busy import EngineBusy, idle_ratio


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_overlapping_requests_count_once_and_pauses_are_idle():
    clock = FakeClock()
    busy = EngineBusy(now=clock)
    clock.t = 1.0
    busy.request_started()  # [1, 5]
    clock.t = 2.0
    busy.request_started()  # [2, 7], overlaps the first: union [1, 7] before the pause
    clock.t = 5.0
    busy.request_finished()
    clock.t = 6.0
    busy.pause()  # paused [6, 8] with one request still open: idle
    clock.t = 8.0
    busy.resume()
    clock.t = 9.0
    busy.request_finished()
    clock.t = 10.0
    assert busy.report() == {"busy_s": pytest.approx(5.0 + 1.0), "window_s": 10.0}  # [1, 6] and [8, 9]


def test_report_splits_an_open_interval_between_windows():
    clock = FakeClock()
    busy = EngineBusy(now=clock)
    busy.request_started()
    clock.t = 4.0
    assert busy.report() == {"busy_s": 4.0, "window_s": 4.0}
    clock.t = 6.0
    busy.request_finished()
    clock.t = 10.0
    assert busy.report() == {"busy_s": 2.0, "window_s": 6.0}


def test_requests_queued_while_paused_are_not_busy():
    clock = FakeClock()
    busy = EngineBusy(now=clock)
    busy.pause()
    clock.t = 3.0
    busy.request_started()
    clock.t = 5.0
    busy.resume()
    clock.t = 6.0
    assert busy.report()["busy_s"] == 1.0


def test_unbalanced_finish_is_an_error():
    with pytest.raises(RuntimeError, match="without a matching"):
        EngineBusy().request_finished()


def test_idle_ratio_weighs_engines_by_their_windows():
    reports = [{"busy_s": 3.0, "window_s": 4.0}, {"busy_s": 0.0, "window_s": 4.0}]
    assert idle_ratio(reports) == pytest.approx(1 - 3 / 8)  # one engine idle counts, though the other is busy
    assert idle_ratio([]) == 0.0
