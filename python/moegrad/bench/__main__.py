"""``python -m moegrad.bench``: the command line of moegrad.bench (see its docstring, --help)."""
import sys

from . import main

sys.exit(main())
