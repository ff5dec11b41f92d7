"""The base layer: errors, configuration, the rank's environment, durable writes, stop signals, threads
and progress bars. Imports nothing else of hpctrain."""
