"""Import Opacus without the change it makes to the root logger.

Opacus (1.5: `opacus/utils/module_utils.py`, which `import opacus` loads) calls `logging.basicConfig()` when
it is imported, which gives the root logger a stderr handler at level NOTSET. Flower's "flwr" logger has its
own console handler and propagates to the root, so from that import on every Flower log line was printed
twice, once as `INFO :      Round 1/30: ...` and once as `11/23/2026 00:54:33:INFO:Round 1/30: ...`, and
DEBUG lines that the app keeps out of the log (e.g. which node's reply was rejected) were printed too.
The server imports Opacus for its RDP accountant (the default job's epsilon against the server) and for
ALI-DPFL's model; ALI-DPFL's ClientApp for DP-SGD.

Every module of this project calls `import_opacus()` before its first `from opacus ... import`: Opacus is
then imported once, here, while the root logger holds a NullHandler, so its `basicConfig()` configures nothing
(it never does when the root has a handler). Removing the handler after the import instead would leave a
window in which other threads' lines (Flower's simulation logs while the ServerApp imports) print twice.
"""

from __future__ import annotations

import logging


def import_opacus():
    """`import opacus` without Opacus' `logging.basicConfig()` taking effect; returns the module."""
    root = logging.getLogger()
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        import opacus
    finally:
        root.removeHandler(placeholder)
    return opacus
