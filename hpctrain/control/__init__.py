"""The control layer: the trainer loop, its step, how it resumes, the watchdog and run logs (what a checkpoint holds
and how it is written and read is `hpctrain.checkpoint`)."""
