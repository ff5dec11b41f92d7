"""The data layer: per-rank HDF5 shards, their manifest, the sources they are written from, and the reader."""
