"""Write ``vlmbind/core/declared_models.json`` again: the rows ``vlmbind models`` lists, from the built models.

Run it after adding a tiny model or shipping an organism again (``tests/app/test_cli.py`` fails until the file is
what the models give):

    .venv/bin/python scripts/declare_models.py
"""

from __future__ import annotations

from vlmbind.app.commands.models import write_declarations

if __name__ == "__main__":
    print(f"wrote {write_declarations()}")
