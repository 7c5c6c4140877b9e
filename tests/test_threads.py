"""The threading choice (nbmoe/__init__.py): Numba's OpenMP layer, whose idle threads sleep at
once, or, where NBMOE_SPIN_POLLS asks, poll briefly first on an idle machine with cores to spare.

libgomp reads its settings once, when Numba first runs in parallel, and OMP_DISPLAY_ENV makes
it print the values it took; so each case is a fresh process that imports nbmoe and runs a
parallel kernel.
"""
import os
import subprocess
import sys

import pytest

from nbmoe import config, omp_wait_settings

PROBE = """
import numba
import numpy as np

import nbmoe  # noqa: F401

@numba.njit(parallel=True)
def total(a):
    s = 0.0
    for i in numba.prange(a.shape[0]):
        s += a[i]
    return s

assert total(np.ones(64)) == 64.0
print(",".join(numba.config.THREADING_LAYER_PRIORITY), numba.threading_layer())
"""


def probe(**env):
    """(Numba's layer order, the layer it runs, libgomp's settings as printed) in a fresh process."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV", "NBMOE_SPIN_POLLS",
                          "NBMOE_SPIN_MIN_CPUS", "NBMOE_SPIN_MAX_LOAD", "NUMBA_THREADING_LAYER",
                          "NUMBA_THREADING_LAYER_PRIORITY")}
    clean.update(env, OMP_DISPLAY_ENV="VERBOSE")
    out = subprocess.run([sys.executable, "-c", PROBE], env=clean, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    order, layer = out.stdout.split()[-2:]
    return order, layer, out.stderr


@pytest.mark.parametrize("env", [
    {},                                                         # the default
    {"NBMOE_SPIN_POLLS": "3000", "NBMOE_SPIN_MIN_CPUS": "100000"},  # polls asked for, too few CPUs
])
def test_threads_sleep_at_once(env):
    order, layer, err = probe(**env)
    assert order == ",".join(config.THREADING_LAYERS) and order.startswith("omp")
    if layer != "omp":
        pytest.skip(f"Numba has no OpenMP layer here; it runs {layer}")
    assert f"OMP_WAIT_POLICY = '{config.OMP_WAIT_POLICY}'" in err
    assert "GOMP_SPINCOUNT = '0'" in err          # PASSIVE: no polling at all


def test_asked_for_idle_machines_threads_poll_briefly():
    # any machine counts as idle and large enough here
    _, layer, err = probe(NBMOE_SPIN_MIN_CPUS="1", NBMOE_SPIN_MAX_LOAD="1e9", NBMOE_SPIN_POLLS="2345")
    if layer != "omp":
        pytest.skip(f"Numba has no OpenMP layer here; it runs {layer}")
    assert "GOMP_SPINCOUNT = '2345'" in err      # (libgomp shows the policy as PASSIVE still)


@pytest.mark.parametrize("polls, environ, cpus, load, settings", [
    (0, {}, 16, 0.0, {"OMP_WAIT_POLICY": "PASSIVE"}),                    # the default: no polling
    (3000, {}, 16, 1.5, {"GOMP_SPINCOUNT": "3000"}),                     # asked for, idle GPU host
    (3000, {}, 16, 9.0, {"OMP_WAIT_POLICY": "PASSIVE"}),                 # asked for, busy
    (3000, {}, 2, 0.0, {"OMP_WAIT_POLICY": "PASSIVE"}),                  # asked for, small VM
    (3000, {"OMP_WAIT_POLICY": "ACTIVE"}, 16, 0.0, {}),                  # the user's choice
    (0, {"GOMP_SPINCOUNT": "10"}, 2, 9.0, {}),
])
def test_wait_rule(polls, environ, cpus, load, settings, monkeypatch):
    for name, value in (("SPIN_POLLS", polls), ("SPIN_MIN_CPUS", 8), ("SPIN_MAX_LOAD", 0.5)):
        monkeypatch.setattr(config, name, value)           # whatever the environment says
    assert omp_wait_settings(environ, cpus, load) == settings


@pytest.mark.parametrize("env, shown", [
    ({"GOMP_SPINCOUNT": "123456"}, "GOMP_SPINCOUNT = '123456'"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "OMP_WAIT_POLICY = 'ACTIVE'"),
])
def test_a_users_wait_setting_wins(env, shown):
    _, layer, err = probe(**env)
    if layer != "omp":
        pytest.skip(f"Numba has no OpenMP layer here; it runs {layer}")
    assert shown in err
    assert "GOMP_SPINCOUNT = '0'" not in err


def test_a_users_layer_order_wins():
    order, _, _ = probe(NUMBA_THREADING_LAYER_PRIORITY="workqueue omp tbb")
    assert order == "workqueue,omp,tbb"
