"""Run a test once per Redis mode: ``@all_redis_modes`` (standalone, sentinel, cluster).

The ``redis_mode`` fixture (tests/conftest.py) picks the session topology;
``proxy_deps``/``redis_settings`` then point the proxy at it and ``state_client``
is a client of the same kind for inspecting keys.
"""

import pytest

REDIS_MODES = ("standalone", "sentinel", "cluster")

all_redis_modes = pytest.mark.parametrize("redis_mode", REDIS_MODES, indirect=True)
