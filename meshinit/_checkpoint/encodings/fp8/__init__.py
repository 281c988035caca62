"""float8 weights with block scales (DeepSeek, Kimi, the Qwen FP8 releases),
dequantized on the devices."""
