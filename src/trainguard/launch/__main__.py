"""``python -m trainguard.launch``: the same as ``trainguard launch``."""

from trainguard.launch.cli import main

raise SystemExit(main())
