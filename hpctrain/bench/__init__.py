"""`hpctrain bench`: the measurements behind the performance page. The training step beside its limit and torch
DDP, and the allreduce (`train`), the limit a user's own plain torch step sets (`limit`), a step split over the
ranks with --tp/--pp (`parallel`), the shard reader (`data`), and the watchdog that ends a bench whose rank
stops making progress (`watch`). The commands are in `cli/bench.py`."""
