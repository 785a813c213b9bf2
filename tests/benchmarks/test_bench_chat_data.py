"""benchmarks/chat_data.py: the conversational mix teaches exactly the instruction rows' answers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from chat_data import SYSTEM, conversational_mix  # noqa: E402

from apt_ds.io.conversations import messages_of  # noqa: E402


def test_rows_become_two_exchange_conversations_in_alternating_formats():
    rows = [{"instruction": "Label it.", "input": f"sentence {i}", "output": ("negative", "positive")[i % 2]}
            for i in range(5)]
    mix = conversational_mix(rows)
    assert [next(iter(row)) for row in mix] == ["messages", "conversations"]  # the odd fifth row is left out
    for number, row in enumerate(mix):
        messages = messages_of(row, number)
        assert messages[0] == {"role": "system", "content": SYSTEM, "learn": True}
        assert [m["content"] for m in messages if m["role"] == "assistant"] == [r["output"] for r in rows[2 * number: 2 * number + 2]]
        assert [m["content"] for m in messages if m["role"] == "user"] == [f"Label it.\n\n{r['input']}" for r in rows[2 * number: 2 * number + 2]]
