"""Import Opacus without the change it makes to the root logger.

Opacus (1.5: `opacus/utils/module_utils.py`, which `import opacus` loads) calls `logging.basicConfig()` when
it is imported, which gives the root logger a stderr handler at level NOTSET. Flower's "flwr" logger has its
own console handler and propagates to the root, so from that import on every Flower log line was printed
twice, once as `INFO :      Round 1/30: ...` and once as `11/23/2026 00:54:33:INFO:Round 1/30: ...`, and
DEBUG lines that the app keeps out of the log (e.g. which node's reply was rejected) were printed too.
The server imports Opacus for its RDP accountant (the default job's epsilon against the server) and for
ALI-DPFL's model; ALI-DPFL's ClientApp for DP-SGD.

Every module of this project calls `import_opacus()` before its first `from opacus ... import`: Opacus is
then imported once, here, and the root logger keeps the handlers it had.
"""

from __future__ import annotations

import logging


def import_opacus():
    """`import opacus`, leaving the root logger's handlers as they were; returns the module."""
    root = logging.getLogger()
    kept = list(root.handlers)
    try:
        import opacus
    finally:
        for handler in [h for h in root.handlers if h not in kept]:
            root.removeHandler(handler)
    return opacus
