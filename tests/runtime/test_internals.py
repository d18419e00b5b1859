"""Every private Lightning/DeepSpeed/torch name the package relies on still exists in the installed versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hetero.runtime.internal_access import resolve
from lightning_hetero.runtime.internals import INTERNALS


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: f"{i.module}.{i.name}")
def test_private_name_still_exists(internal):
    try:
        resolve(internal)
    except (AttributeError, ImportError) as error:
        pytest.fail(f"{internal.module}.{internal.name} is gone ({error}); the package relies on it: {internal.why}")


def test_every_entry_says_where_it_is_used_and_why():
    import lightning_hetero

    package = Path(lightning_hetero.__file__).parent
    for internal in INTERNALS:
        assert internal.use in ("patched", "read", "called")
        assert internal.by and internal.why
        for module in internal.by.split(", "):
            assert (package / module).is_file(), f"{internal.name}: `by` names no module of the package: {module}"
        if internal.use == "patched":
            assert internal.undone, f"{internal.name}: a patch must say where it is put back"


def test_a_patch_is_put_back_even_when_the_block_fails():
    import importlib

    from lightning_hetero.runtime import startup

    # (`deepspeed.comm.torch` as an attribute is the torch package that deepspeed.comm imports, not the module)
    backend_module = importlib.import_module("deepspeed.comm.torch")
    original = backend_module.build_shm_op
    with pytest.raises(KeyError), startup.without_shared_memory_comm_op():
        assert backend_module.build_shm_op() is None
        raise KeyError("inside")
    assert backend_module.build_shm_op is original


def test_an_instance_attribute_is_found_in_the_code_that_sets_it_and_a_missing_one_is_refused():
    from lightning_hetero.runtime.internal_access import Internal

    def named(name):
        return Internal("deepspeed.runtime.zero.stage_1_and_2", name, "read", "-", "-")

    assert resolve(named("DeepSpeedZeroOptimizer#single_partition_of_fp32_groups")).__name__ == "DeepSpeedZeroOptimizer"
    with pytest.raises(AttributeError, match="no longer sets `self.partition_that_never_was`"):
        resolve(named("DeepSpeedZeroOptimizer#partition_that_never_was"))


def test_every_private_name_the_package_imports_from_a_library_is_listed():
    """An underscore name imported from Lightning, DeepSpeed or torch must be in the list (attribute accesses are
    listed by hand; this catches the imports mechanically)."""
    import ast
    from pathlib import Path

    import lightning_hetero
    from lightning_hetero.runtime.internals import INTERNALS

    listed = {(internal.module, internal.name) for internal in INTERNALS}
    libraries = ("lightning", "deepspeed", "torch")
    missing = []
    package = Path(lightning_hetero.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in libraries:
                for alias in node.names:
                    if alias.name.startswith("_") and (node.module, alias.name) not in listed:
                        missing.append(f"{path.relative_to(package)}:{node.lineno} {node.module}.{alias.name}")
    assert not missing, "private names imported but not in lightning_hetero/runtime/internals.py: " + ", ".join(missing)


# Private attributes of the standard library the package reads (the list covers Lightning, DeepSpeed and torch).
STANDARD_LIBRARY_PRIVATES = {
    "_exit": "os._exit: leave at once with a code, past atexit handlers (runtime/shutdown.py, recover/)",
    "_mapping": "collections.abc.KeysView._mapping: the mapping a keys view reads (configure/deepspeed_config.py)",
}


def test_every_private_attribute_the_package_reads_is_its_own_or_listed():
    """An attribute access ``x._name`` where nothing in the package defines ``_name`` (a function, class, variable,
    attribute or argument of that name) reads another library's private: it must be in the list, by its last name
    component, or be one of the standard library's above. (A new ``engine._foo`` fails here until it is listed.)"""
    import ast
    import re
    from pathlib import Path

    import lightning_hetero
    from lightning_hetero.runtime.internals import INTERNALS

    package = Path(lightning_hetero.__file__).parent
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                defined.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
    listed = {part for internal in INTERNALS for part in re.split(r"[.#()]", internal.name) if part}
    unlisted = sorted(
        f"{path.relative_to(package)}:{node.lineno} .{node.attr}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in defined | listed | set(STANDARD_LIBRARY_PRIVATES)
    )
    where = "lightning_hetero/runtime/internals.py"
    assert not unlisted, f"private attributes read but not listed in {where}: " + ", ".join(unlisted)
