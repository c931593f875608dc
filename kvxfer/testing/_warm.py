"""Imported once by the harness's forkserver (`kvxfer.testing.processes`) before it forks the
rank processes: what every rank imports anyway. A module that fails to import here is left to
the child, which imports it again and reports the error as its own."""

import importlib

for _name in (
    "torch",
    "numpy",
    "msgspec",
    "zmq",
    "kvxfer.spec",
    "kvxfer.reference",
    "kvxfer.connector",
    "kvxfer.testing.ranks",
    "kvxfer.testing.cluster",
):
    try:
        importlib.import_module(_name)
    except Exception:  # the child imports it again and reports the error
        continue
