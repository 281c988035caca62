"""meshinit on real frameworks' own code (MaxText, tunix, gemma), imported, never vendored."""
