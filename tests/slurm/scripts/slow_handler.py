"""A rank program that handles SIGUSR2 only after a slow start, as a trainer does once torch is imported.

argv: RUN_DIR STARTUP_S. Marks each moment in RUN_DIR (rank R, restart K) so the test can signal it there:
- restart 0: `started-R-0` at once; after STARTUP_S a SIGUSR2 handler; the SIGUSR2s it got go to `stop-R`,
  and it exits 3 (a checkpointed stop) when there was one, else 0 after 10 s;
- restart 1: a handler that it gives back at its "last step" (to the disposition it inherited, as the
  trainer does), then `ending-R-1`, a 3 s wind-down, exit 0.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

run, startup = Path(sys.argv[1]), float(sys.argv[2])
rank, restart = os.environ["SLURM_PROCID"], os.environ.get("SLURM_RESTART_COUNT", "0")
got: list[int] = []

if restart != "0":
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
    signal.signal(signal.SIGUSR2, previous)
    (run / f"ending-{rank}-{restart}").touch()
    time.sleep(3)
    sys.exit(0)

(run / f"started-{rank}-0").touch()
time.sleep(startup)  # no handler yet: SIGUSR2's default action would end the process here
signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
deadline = time.monotonic() + 10
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(run / f"stop-{rank}").write_text(json.dumps(got))
sys.exit(3 if got else 0)
