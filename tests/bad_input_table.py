"""Rewrite docs/bad-inputs.md's table from tests/test_bad_inputs.py (between its marker comments).

`python tests/bad_input_table.py [FILE]` (default docs/bad-inputs.md); a file without exactly one pair of markers is
an error, so the table cannot be dropped silently by pointing this at the wrong file.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_bad_inputs import markdown_table  # noqa: E402

START, END = "<!-- bad-input-table:start -->", "<!-- bad-input-table:end -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"

if __name__ == "__main__":
    doc = Path(sys.argv[1]) if len(sys.argv) > 1 else DOC
    text = doc.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        sys.exit(f"{doc}: needs one {START} and one {END} (the table lives in docs/bad-inputs.md)")
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{markdown_table()}\n{END}", text,
                 flags=re.S)
    doc.write_text(new)
