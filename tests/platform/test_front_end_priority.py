"""The front end's threads run below the engine's (platform/priority.py), read back from the OS."""

from __future__ import annotations

import argparse
import os
import sys
import threading

import pytest

from loramux.platform.cli.flags import add_settings_arguments, settings_from_args
from loramux.platform.priority import lower_front_end
from loramux.platform.settings import Settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _in_thread(fn):
    """fn() on a fresh thread (niceness cannot be lowered again: keep it off the test's own),
    with that thread's id and the niceness of a thread it started afterwards."""
    out = {}

    def run():
        out["result"] = fn()
        out["tid"] = threading.get_native_id()
        child = threading.Thread(target=lambda: out.setdefault("child", _nice(threading.get_native_id())))
        child.start()
        child.join()
        out["after"] = _nice(out["tid"])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_the_calling_thread_and_its_later_threads_go_below_the_rest():
    mine = _nice(threading.get_native_id())
    out = _in_thread(lambda: lower_front_end(3))
    assert out["result"] == out["after"] == min(19, mine + 3)
    assert out["child"] == out["after"]  # threads the loop starts later inherit it
    assert _nice(threading.get_native_id()) == mine  # the engine's (here the test's) thread keeps its own


def test_zero_changes_nothing_and_the_cap_is_19():
    mine = _nice(threading.get_native_id())
    out = _in_thread(lambda: lower_front_end(0))
    assert out["result"] is None and out["after"] == out["child"] == mine
    assert _in_thread(lambda: lower_front_end(19))["after"] == 19


def test_the_setting_defaults_to_0_and_refuses_out_of_range():
    assert Settings().front_end_nice == 0
    with pytest.raises(ValueError, match="front_end_nice"):
        Settings(front_end_nice=20)
    with pytest.raises(ValueError, match="front_end_nice"):
        Settings(front_end_nice=-1)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ["front_end_nice"])
    assert settings_from_args(parser.parse_args(["--front-end-nice", "5"])).front_end_nice == 5
