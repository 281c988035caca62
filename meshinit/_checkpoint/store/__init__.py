"""Where a checkpoint's bytes live: local files and remote objects, one ``Source``
type, listed, checked as the format requires, and fetched by byte range."""
