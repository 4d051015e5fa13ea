#!/usr/bin/env python
"""Run astuner from a source checkout, same as the `astuner` command:

    python launcher.py --conf tutorial/quickstart/quickstart.yaml --backbone debug

Handy for debuggers (see .vscode/launch.json): breakpoints in the debug backbone work as it runs in-process.
"""

import sys
from pathlib import Path

# Prefer this checkout's package over any installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from astuner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
