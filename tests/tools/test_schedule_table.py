"""docs/schedules.md's table of schedules is what graphc/tools/schedule_table.py makes from the
registry (See NOTE: Schedule registry): a schedule added or changed shows there, or this fails."""
from pathlib import Path

from graphc.plan.schedules import SCHEDULES
from graphc.tools.schedule_table import table

DOC = Path(__file__).parents[2] / "docs" / "schedules.md"


def test_docs_table_is_the_registrys():
    doc = DOC.read_text()
    assert table() in doc, "docs/schedules.md: run python -m graphc.tools.schedule_table and paste"
    rows = [line for line in table().splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == sorted(SCHEDULES)


def test_table_reads_peaks_and_backwards_from_the_orders():
    text = table()
    assert "| `1f1b` (default) | Schedule1F1B | stage r | B |" in text
    assert "| `dualpipev` | ScheduleDualPipeV | stages r, 2p-1-r | B, OVERLAP_F_B, I, W |" in text
    assert text.splitlines()[2].endswith("| 4, 3, 2, 1 |")   # 1f1b: min(p - r, m) at p=4, m=16
