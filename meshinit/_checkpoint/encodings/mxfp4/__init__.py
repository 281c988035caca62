"""MXFP4 (gpt-oss): blocks of e2m1 codes under e8m0 exponents, dequantized on the
devices."""
