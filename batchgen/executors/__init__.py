"""Executors other than the local one. `ray_executor` runs a job's rows on a Ray cluster
(one engine per worker actor) into the same run directory the local executor uses; the
pieces it shares with the local executor live in batchgen.run."""
