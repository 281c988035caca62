"""``from_constructor``: the initializer of constructor-made specs is never called."""

import jax
import jax.numpy as jnp
import pytest

from meshinit._spec.constructor import from_constructor


def test_calling_it_names_the_adapters_to_use_instead():
    with pytest.raises(TypeError, match=r"meshinit.nnx.init\(factory\)") as info:
        from_constructor(jax.random.key(0), (2,), jnp.float32)
    assert "meshinit.eqx.init(factory, key, placements)" in str(info.value)
