"""The data layer: per-rank HDF5 shards, their manifest, the sources they are written from, the reader, and where a
run stands in its data."""
