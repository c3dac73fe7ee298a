"""What a resume from an earlier step moves out of the way, and the notes that say so.

A run that continues from step ``N`` of a folder leaves the later steps (a branch it
does not continue) where nothing resumes them by accident, never deleting them:
:meth:`meshplan.Checkpointer.branch_from` moves them aside and returns a
:class:`Branched` record, one :class:`~meshplan._errors.Note` per move, which a caller
words in its own terms from the note's code and fields.
"""

from __future__ import annotations

from typing import NamedTuple

from meshplan._errors import Note

__all__ = ["Branched", "damaged_note", "set_aside_note"]


class Branched(NamedTuple):
    """What :meth:`~meshplan.Checkpointer.branch_from` moved aside.

    Attributes:
        notes: One note per move (``'damaged-step-moved'``, ``'steps-set-aside'``).
        set_aside: ``(steps, folder)``: the intact later steps and where they went, or
            ``None``.
    """

    notes: list[Note]
    set_aside: tuple[list[int], str] | None


def set_aside_note(steps: list[int], folder: str, step: int, moved_to: str) -> Note:
    """The note of a resume from ``step`` that moved the later ``steps`` into ``moved_to``.

    Example:
        >>> from meshplan._checkpoint.branch import set_aside_note
        >>> note = set_aside_note([4], "run", 2, "run/old-branch-after-step-2")
        >>> note.code, note.fields["steps"]
        ('steps-set-aside', [4])
    """
    them = "them" if len(steps) > 1 else "it"
    template = (
        f"Step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))} of {folder!r} came after "
        f"step {step}, on the branch this run leaves: moved into {moved_to!r} (nothing "
        f"deleted), so that neither this run nor a later {{resume}} mixes {them} in. Move "
        f"{them} back to continue that branch."
    )
    fields = {"steps": steps, "folder": folder, "step": step, "moved_to": moved_to}
    return Note(template, "steps-set-aside", fields, {"resume": "resume"})


def damaged_note(step: int, folder: str, moved_to: str, why: str) -> Note:
    """The note of a damaged ``step`` of ``folder`` moved into ``moved_to`` (never deleted).

    Example:
        >>> from meshplan._checkpoint.branch import damaged_note
        >>> damaged_note(3, "run", "run/damaged-step-3", "bytes changed").code
        'damaged-step-moved'
    """
    template = (
        f"Moved damaged step {step} of {folder!r} into {moved_to!r} (nothing deleted; the "
        f"reason is in why.txt there): {why}"
    )
    fields = {"step": step, "folder": folder, "moved_to": moved_to, "why": why}
    return Note(template, "damaged-step-moved", fields, {})
