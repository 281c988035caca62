"""How stored bytes encode values: each encoding a sibling (float8 with block scales,
MXFP4, typed PRNG keys) that imports no other."""
