"""Suite-wide settings.

The plan cache (``plan_cache=True`` by default) would let a run reuse a plan that an earlier test, or an
earlier run on this machine, selected: results would depend on what ran before. ``PIPEDAP_PLAN_CACHE=off``
turns the default off for every test and every process a test starts (they inherit the environment); the
tests of the plan cache pass ``plan_cache=<tmp_path>`` explicitly (tests/test_plan_cache.py).
"""

import os

os.environ["PIPEDAP_PLAN_CACHE"] = "off"
