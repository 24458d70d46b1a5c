"""Run examples/generate.py with one rank failing (test helper for test_hardening.py; not a test module).

    torchrun --nproc-per-node 2 tests/tp_failing_rank.py RANK WHEN -- <examples/generate.py flags>

Rank RANK raises RuntimeError WHEN ("load": while loading its slices, "generate": as its generation starts,
while the other ranks are inside their first collective of the forward), as a bug or an out-of-memory would.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import minimax_ref.cli.generate as cli_generate

rank, when = int(sys.argv[1]), sys.argv[2]
argv = sys.argv[sys.argv.index("--") + 1:]
if int(os.environ.get("RANK", "0")) == rank:
    if when == "generate":
        import minimax_ref.generation.generate  # noqa: F401  (the submodule; the package attribute names the function)

        def failing(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {rank}")

        sys.modules["minimax_ref.generation.generate"].generate = failing  # what cli/generate.py imports and calls
    else:

        def failing_load(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {rank} while loading")

        cli_generate.load_from_args = failing_load  # where run_generate looks it up
sys.argv = ["examples/generate.py", *argv]
runpy.run_path(str(Path(__file__).parents[1] / "examples" / "generate.py"), run_name="__main__")
