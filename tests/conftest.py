"""Suite-wide settings.

The plan cache (``plan_cache=True`` by default) would let a run reuse a plan that an earlier test, or an
earlier run on this machine, selected: results would depend on what ran before. ``PIPEDAP_PLAN_CACHE=off``
turns the default off for every test and every process a test starts (they inherit the environment); the
tests of the plan cache pass ``plan_cache=<tmp_path>`` explicitly (tests/test_plan_cache.py).
"""

import os

os.environ["PIPEDAP_PLAN_CACHE"] = "off"

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    """A test that fits in this process (Fabric or a Trainer with one device) leaves Lightning's launcher variables
    (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) in ``os.environ``; a later test that starts a job under
    Lightning's launcher then inherits them, its script believes it was launched externally and waits for a rank
    that never comes (test_lightning_cli and test_faults hung after test_fabric's one-process test). Every test
    gets the environment back as it found it."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
