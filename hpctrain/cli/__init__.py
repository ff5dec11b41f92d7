"""The command line: one file per command group; each command parses, builds a config, calls the library, prints."""
