"""Train an organism: ``python -m vlmbind.organisms --config run.json --out DIR [--resume] [--threads N]``."""

import sys

from .cli import main

sys.exit(main())
