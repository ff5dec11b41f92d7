"""Seeing inside a run: the flight recorder of collectives, the timeline of every rank, and what they show.

A layer just above `base`, below the comm layer that feeds it (it imports neither mpi4py nor torch):

- `flight`: `RECORDER`, always on: each rank's last collectives in a preallocated ring, dumped to
  RUN/logs/rank-NNNN.flight.json when the watchdog aborts the job, a stop is forced or a rank fails;
- `spans`: `TRACER`, on with `--trace WINDOW`: spans of every phase of the steps of a bounded window, per rank;
- `chrome`: the ranks' files merged into one Chrome trace (RUN/trace.json, opened by ui.perfetto.dev);
- `straggler`: arrivals at every traced collective, who made the others wait, in which phase, and the verdict;
- `lineup`: the flight records of every rank lined up: the first collective where the ranks diverge, who
  never arrived.
"""
