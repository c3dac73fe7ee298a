"""A JSON-lines file that stays valid across crashes: a half-written last line is cut off.

A run that stops while writing a line (a full disk, ``kill -9``) leaves the file
ending without a newline; the next run that appends (``--resume --metrics FILE``)
would glue its first record onto that half and leave a line that is not JSON.
:func:`cut_partial_line` removes that unfinished tail before anything is appended
(it is said, never silent): every line of the file is then a whole record.
"""

from __future__ import annotations

import os

__all__ = ["cut_partial_line"]


def cut_partial_line(fd: int) -> bytes:
    """Truncates the open file ``fd`` after its last newline; returns what was cut (``b''``).

    Example:
        >>> import os, tempfile
        >>> from meshplan.cli.jsonl import cut_partial_line
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "m.jsonl")
        ...     with open(path, "w") as f:
        ...         _ = f.write('{"step": 1}\\n{"step": 2, "lo')
        ...     fd = os.open(path, os.O_RDWR)
        ...     print(cut_partial_line(fd), open(path).read().splitlines())
        ...     os.close(fd)
        b'{"step": 2, "lo' ['{"step": 1}']
    """
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return b""
    block = 1 << 16
    end = size
    while end > 0:  # the last newline, reading back block by block
        start = max(0, end - block)
        chunk = os.pread(fd, end - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            keep = start + cut + 1
            break
        end = start
    else:
        keep = 0
    tail = os.pread(fd, size - keep, keep)
    os.ftruncate(fd, keep)
    return tail
