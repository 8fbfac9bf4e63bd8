"""Subprocess output without ANSI colour codes where it goes to a file or a pipe.

Flower's log handler (`flwr.supercore.logger.ConsoleHandler`) colours every level name, whatever its output
is, and offers no switch for it: the ServerApp's log that `flwr run --stream` prints carries the codes into
`| tee`, CI logs and files. `call_plain_when_piped` runs a command as `subprocess.call` does, but reads each
of its streams that would go to a non-terminal and passes it on without the codes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from typing import TextIO

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def without_colours(text: str) -> str:
    """`text` without ANSI escape sequences (colours, resets, cursor moves)."""
    return ANSI_ESCAPE.sub("", text)


def copy_plain(source: TextIO, target: TextIO) -> None:
    """Copy `source` line by line to `target`, without ANSI codes, flushing each line (a live log stays live)."""
    for line in source:
        target.write(without_colours(line))
        target.flush()


def call_plain_when_piped(cmd: list[str], env: dict | None = None, preexec_fn=None) -> int:
    """`subprocess.call(cmd, env=env, preexec_fn=preexec_fn)`, except that what would reach a non-terminal stdout or stderr loses its
    ANSI codes on the way. Streams going to a terminal are the child's own, as before."""
    targets = {name: getattr(sys, name) for name in ("stdout", "stderr") if not getattr(sys, name).isatty()}
    if not targets:
        return subprocess.call(cmd, env=env, preexec_fn=preexec_fn)
    pipe = {name: subprocess.PIPE if name in targets else None for name in ("stdout", "stderr")}
    with subprocess.Popen(cmd, env=env, text=True, errors="replace", bufsize=1, preexec_fn=preexec_fn, **pipe) as proc:
        copiers = [
            threading.Thread(target=copy_plain, args=(getattr(proc, name), target), daemon=True)
            for name, target in targets.items()
        ]
        for copier in copiers:
            copier.start()
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C: as subprocess.call, end the child and let the caller clean up
            proc.kill()
            raise
        for copier in copiers:
            copier.join(timeout=5)
    return code
