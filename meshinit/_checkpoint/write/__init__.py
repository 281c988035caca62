"""The write side of the checkpoint stage: :func:`meshinit.safetensors.save`, the
loader's ``names=`` read in reverse, every process writing its own files at once."""
