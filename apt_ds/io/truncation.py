"""What max_seq_len and unusable rows cost the data: counted while tokenizing, reported in one
warning line at the start of a run and recorded in run.json's `truncation`."""

from __future__ import annotations

from apt_ds.io.records import USABLE_FIELDS

# The counts of rows that made no example (each row is counted in at most one of them)
LOST_KINDS = ("skipped", "dropped", "turn_dropped", "without_reply", "rewritten")


class TruncationStats:
    """What the data lost. To max_seq_len: rows whose prompt was cut from the left, rows dropped
    because their response alone did not fit, unpacked text rows cut at the end, conversations cut
    after their last whole turn that fits or inside their first assistant turn, and the longest of
    the rows that were cut or dropped (the longest row of all when any was; 0 when every row
    fitted). Besides: rows skipped for having no usable text (e.g. an empty or null output) or, for
    conversations, no assistant turn, and the first of each (1-based)."""

    def __init__(self):
        self.prompt_cut = self.dropped = self.text_cut = self.turns_cut = self.turn_cut_inside = self.turn_dropped = 0
        self.rewritten = 0
        self.longest = 0
        self.skipped = self.first_skipped = 0
        self.without_reply = self.first_without_reply = 0

    def count(self, kind: str, length: int) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.longest = max(self.longest, length)

    def count_skipped(self, row_number: int) -> None:
        self.skipped += 1
        self.first_skipped = self.first_skipped or row_number

    def count_without_reply(self, row_number: int) -> None:
        self.without_reply += 1
        self.first_without_reply = self.first_without_reply or row_number

    def to_dict(self) -> dict:
        return {"prompt_cut": self.prompt_cut, "dropped": self.dropped, "text_cut": self.text_cut, "longest": self.longest,
                "skipped": self.skipped, "turns_cut": self.turns_cut, "turn_cut_inside": self.turn_cut_inside,
                "turn_dropped": self.turn_dropped, "without_reply": self.without_reply, "rewritten": self.rewritten}

    def message(self, source: str, max_seq_len: int) -> str | None:
        """One warning line, or None when nothing was cut or skipped."""
        cut = [f"{n} {rows_phrase(n, what)}" for n, what in ((self.prompt_cut, "rows had the prompt cut from the left"),
                                                      (self.dropped, "rows were dropped (the response alone exceeds it)"),
                                                      (self.text_cut, "rows without a prompt were cut at the end"),
                                                      (self.turns_cut, "conversations were cut after the last whole "
                                                                       "turn that fits"),
                                                      (self.turn_cut_inside, "conversations were cut inside the first "
                                                                             "assistant turn"),
                                                      (self.turn_dropped, "conversations were dropped (no reply token "
                                                                          "fits after the turns before it)")) if n]
        parts = [f"--max-seq-len {max_seq_len}: {'; '.join(cut)}; the longest row has {self.longest} tokens"] if cut else []
        if self.skipped:
            parts.append(f"{self.skipped} {rows_phrase(self.skipped, 'rows were')} skipped, having no usable text (the first is row {self.first_skipped}; "
                         f"each row needs {USABLE_FIELDS}, not empty)")
        if self.rewritten:
            parts.append(f"{self.rewritten} {rows_phrase(self.rewritten, 'conversations were')} skipped: the chat template does "
                         "not write an assistant message as it is, so its tokens cannot be found")
        if self.without_reply:
            parts.append(f"{self.without_reply} {rows_phrase(self.without_reply, 'conversations were')} skipped, having no "
                         f"assistant turn to learn (the first is row {self.first_without_reply})")
        return f"warning: {source}: {'; '.join(parts)}" if parts else None


def rows_phrase(count: int, words: str) -> str:
    """ "rows had ..." as "row had ..." for one: `words` starts with a plural ("rows", "conversations";
    "were" becomes "was")."""
    if count == 1:
        first, space, rest = words.partition(" ")
        return first[:-1] + space + rest.replace("were", "was", 1)
    return words
