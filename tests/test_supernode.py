"""dpfl_tools.supernode: Flower's own SuperNode with its idle sleeps capped, and nothing else changed."""

from __future__ import annotations

import time

import pytest

from dpfl_tools import supernode


def test_capped_sleep_caps_and_passes_everything_else_through(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    capped = supernode.CappedSleep(0.2)
    for seconds in (3, 0.5, 0.05, 0.01):  # Flower's idle sleep asks the SuperLink next; the 0.5 s waits ask no one
        capped.sleep(seconds)
    assert slept == [0.2, supernode.LOCAL_WAIT_CAP, supernode.LOCAL_WAIT_CAP, 0.01] and supernode.LOCAL_WAIT_CAP == 0.02
    slept.clear()
    supernode.CappedSleep(0.01).sleep(0.5)  # never longer than the idle poll
    assert slept == [0.01]
    assert capped.time is time.time and capped.monotonic is time.monotonic


def test_the_installed_flower_loop_is_recognised_and_patched(monkeypatch):
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(loop, "time", time)  # undone after the test
    assert supernode.shorten_idle_sleeps(0.1) is loop
    assert isinstance(loop.time, supernode.CappedSleep) and loop.time.cap == 0.1


def test_an_unknown_flower_loop_is_refused_not_silently_left_alone(monkeypatch):
    import flwr
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(loop, "time", time)
    monkeypatch.setattr(supernode.inspect, "getsource", lambda _module: "while True: pass")
    with pytest.raises(RuntimeError, match=f"flwr {flwr.__version__}.*run flower-supernode"):
        supernode.shorten_idle_sleeps(0.2)
    assert loop.time is time


@pytest.mark.parametrize("value", ["0", "5"])
def test_idle_poll_out_of_range_is_refused_before_the_node_starts(value, capsys):
    with pytest.raises(SystemExit):
        supernode.main(["--idle-poll", value, "--insecure"])
    assert f"--idle-poll = {float(value)}: must be between 0.01 and 3 seconds" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "5", "soon"])
@pytest.mark.parametrize("cli", ["dpfl_tools.supernode", "dpfl_tools.clientapp_executor"])
def test_pull_backoff_out_of_range_is_refused_by_both_clis(cli, value, capsys):
    from dpfl_tools import clientapp_executor

    main = supernode.main if cli == "dpfl_tools.supernode" else clientapp_executor.main
    with pytest.raises(SystemExit):
        main(["--pull-backoff", value, "--runtime-api-address", "127.0.0.1:1", "--insecure"])
    assert f"--pull-backoff = '{value}': must be a number of seconds from 0.01 to 1.0" in capsys.readouterr().err
