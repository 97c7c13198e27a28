"""Usage: python tools/run_with_tree.py DIR SCRIPT [ARGS...]

Runs SCRIPT (as ``python SCRIPT ARGS`` would) with the ``moe_grouped`` package imported from DIR
(e.g. an older version written by tools/old_tree.sh) instead of the installed one. An editable
install's import hook takes precedence over PYTHONPATH, so it is taken out of ``sys.meta_path``.
"""

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    tree, script = os.path.abspath(sys.argv[1]), sys.argv[2]
    if not os.path.isfile(os.path.join(tree, "moe_grouped", "__init__.py")):
        raise SystemExit(f"{tree} holds no moe_grouped package")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path[:0] = [os.path.dirname(os.path.abspath(script)), tree]
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
