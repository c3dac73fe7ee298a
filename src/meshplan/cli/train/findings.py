"""What the checks of ``meshplan train`` found: every problem collected, then raised once.

A :class:`Findings` holds ``(error class, Problem)`` pairs. Each problem the command
line finds itself is added with its own code (the flag advice of
:data:`~meshplan.cli.train.flags.CODE_ADVICE` is keyed by code) and the flag it is
about as its path, as :func:`meshplan._errors.error_for` builds a library error's; the
library's errors are added with their problems' codes, their fixes worded in flags.
"""

from __future__ import annotations

from meshplan._errors import MeshplanError, Problem, problem_message
from meshplan.cli.train.flags import CODE_ADVICE

__all__ = ["Findings"]


class Findings:
    """Collects ``(error class, problem)`` pairs and raises them together.

    Example:
        >>> from meshplan._errors import ArgumentError
        >>> from meshplan.cli.train.findings import Findings
        >>> found = Findings()
        >>> found.add(ArgumentError, "--steps -1 is negative", "Pass --steps 1 or more.",
        ...           "setting-invalid", "--steps")
        >>> [(p.code, p.path) for p in found.problems]
        [('setting-invalid', '--steps')]
    """

    def __init__(self) -> None:
        self.items: list[tuple[type[MeshplanError], Problem]] = []

    @classmethod
    def joined(cls, *parts: Findings) -> Findings:
        """The problems of ``parts``, in that order."""
        out = cls()
        for part in parts:
            out.items.extend(part.items)
        return out

    @property
    def problems(self) -> list[Problem]:
        """The problems found, in the order they were added."""
        return [p for _, p in self.items]

    def add(
        self, cls: type[MeshplanError], message: str, fix: str, code: str, path: str = ""
    ) -> None:
        """A problem the command line found, with its own ``code`` (no default: the flag advice
        is keyed by it) and the flag it is about (``path``)."""
        self.items.append((cls, Problem("error", path, message, fix, code)))

    def add_error(self, error: MeshplanError, where: str = "") -> None:
        """The error's problems, with flag-level advice for the codes the command line knows.

        ``where``: the flag the problems come from (``--rules r.json``), put before each.
        """
        found = error.problems or [Problem("error", "", str(error), "", "error")]
        for p in found:
            message = f"{p.path}: {p.message}" if p.path and p.path not in p.message else p.message
            if where and not message.startswith(where):
                message = f"{where}: {message}"
            fix = CODE_ADVICE.get(p.code, p.fix)
            self.items.append(
                (type(error), Problem("error", where or p.path, message, fix, p.code))
            )

    def raise_if_any(self, header: str) -> None:
        """Raises every problem at once, as the first one's error class: one bullet each, then
        the fixes (each once)."""
        if not self.items:
            return
        found = self.problems
        fixes = list(dict.fromkeys(p.fix for p in found if p.fix))
        raise self.items[0][0](
            problem_message(header, [p.message for p in found], "\n".join(fixes)), found
        )
