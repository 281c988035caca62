"""8 simulated CPU devices, set once for the whole suite, before any backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
