"""`python -m batchgen ...` is the `batchgen` command (for machines without the script)."""

from batchgen.cli import main

main(prog_name="batchgen")
