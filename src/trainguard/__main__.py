"""``python -m trainguard`` runs the command-line tool."""

from trainguard.cli import main

raise SystemExit(main())
