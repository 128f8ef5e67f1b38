"""Rewrite the README's bad-input table from tests/test_bad_inputs.py (between its marker comments)."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_bad_inputs import markdown_table  # noqa: E402

START, END = "<!-- bad-input-table:start -->", "<!-- bad-input-table:end -->"

if __name__ == "__main__":
    readme = Path(sys.argv[1])
    text = readme.read_text()
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{markdown_table()}\n{END}", text,
                 flags=re.S)
    readme.write_text(new)
