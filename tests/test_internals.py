"""Every private Lightning/DeepSpeed/torch name the package relies on still exists in the installed versions."""

from __future__ import annotations

import pytest

from lightning_hetero.internals import INTERNALS, resolve


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: f"{i.module}.{i.name}")
def test_private_name_still_exists(internal):
    try:
        resolve(internal)
    except (AttributeError, ImportError) as error:
        pytest.fail(f"{internal.module}.{internal.name} is gone ({error}); the package relies on it: {internal.why}")


def test_every_entry_says_where_it_is_used_and_why():
    for internal in INTERNALS:
        assert internal.use in ("patched", "read", "called")
        assert internal.by and internal.why
        if internal.use == "patched":
            assert internal.undone, f"{internal.name}: a patch must say where it is put back"


def test_a_patch_is_put_back_even_when_the_block_fails():
    import importlib

    from lightning_hetero import startup

    # (`deepspeed.comm.torch` as an attribute is the torch package that deepspeed.comm imports, not the module)
    backend_module = importlib.import_module("deepspeed.comm.torch")
    original = backend_module.build_shm_op
    with pytest.raises(KeyError), startup.without_shared_memory_comm_op():
        assert backend_module.build_shm_op() is None
        raise KeyError("inside")
    assert backend_module.build_shm_op is original
