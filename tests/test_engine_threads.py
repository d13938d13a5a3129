import os
import sys
import threading

import pytest

from lightning_pipedap.engine.threads import lower_current_thread_priority


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True, "3"])
def test_rejects_bad_increments_naming_the_value(bad):
    with pytest.raises(ValueError, match=r"0\.\.19.*" + repr(bad).replace(".", r"\.")[:3]):
        lower_current_thread_priority(bad)


def test_zero_changes_nothing():
    assert lower_current_thread_priority(0) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux-only")
def test_lowers_only_the_calling_thread_and_new_threads_inherit_it():
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def body():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        restore = lower_current_thread_priority(3)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid) - before
        child = threading.Thread(target=lambda: seen.__setitem__(
            "child", os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - before))
        child.start()
        child.join()
        seen["restored"] = restore()
        seen["final"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["after"] == min(3, 19 - main_before)
    assert seen["child"] == seen["after"]  # threads created afterwards inherit the lower priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    if seen["restored"]:  # root / CAP_SYS_NICE
        assert seen["final"] == 0
    else:
        assert seen["final"] == seen["after"]
