"""Train an organism: ``python -m vlmbind.organisms --config run.json --out DIR [--resume] [--threads N]``."""

import sys

from .train import main

sys.exit(main())
