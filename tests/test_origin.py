"""Whose code is this (`nitro_ipy._base._origin`): notebook cells of both front ends, the standard library,
installed packages, nitro_ipy itself, the user's own module files, and registered exclusions."""

import os
import sys

import numpy as np
import pytest

import nitro_ipy
from nitro_ipy._base import _origin
from tests._modules import import_source

USER_SOURCE = """
class Model:
    def forward(self, x):
        return x

def helper(x):
    return x
"""


@pytest.fixture
def exclusions(monkeypatch):
    """Exclusions registered in a test are forgotten after it (and so are the verdicts they led to)."""
    monkeypatch.setattr(_origin, "_exclusions", list(_origin._exclusions))
    monkeypatch.setattr(_origin, "_prefixes", _origin._prefixes)
    yield
    _origin.verdicts.clear()


def test_terminal_shell_cells_are_user_code():
    name = "<ipython-input-3-0123456789ab>"
    assert _origin.is_user_file(name)
    assert _origin.is_cell_file(name)


def test_kernel_cells_are_user_code():
    name = os.path.join(os.sep + "tmp", "ipykernel_4242", "3405691582.py")
    assert _origin.is_user_file(name)
    assert _origin.is_cell_file(name)


# Every front end's cells and every way of typing code: user code (the positive rule names the library).
USER_PSEUDO_FILES = [
    "<ipython-input-3-0123456789ab>",  # terminal IPython
    "<timed exec>",  # %%time
    "<magic-timeit>",  # %%timeit
    "<stdin>",  # the plain REPL
    "<string>",  # exec of a string, python -c
    "<console>",  # code.interact
    "<cell line: 1>",  # another front end's cell name
]


@pytest.mark.parametrize("name", USER_PSEUDO_FILES)
def test_every_kind_of_cell_and_typed_code_is_user_code(name):
    assert _origin.is_user_file(name)


@pytest.mark.parametrize("name", [
    "<frozen importlib._bootstrap>", "<attrs generated init mod.C>", "<decorator-gen-12>", "", None,
])
def test_frozen_modules_and_code_generators_are_library_code(name):
    assert not _origin.is_user_file(name)


@pytest.mark.parametrize("path", [
    "/tmp/ipykernel_4242/3405691582.py",  # a kernel's cell
    "/home/me/project/train.py",  # a `%run` script, a module file
    "vscode-notebook-cell:/home/me/nb.ipynb#W1sZmlsZQ%3D%3D",  # VS Code's cell names
    os.path.join(os.path.dirname(sys.prefix), "elsewhere", "model.py"),
])
def test_files_outside_the_library_directories_are_user_code(path):
    assert _origin.is_user_file(path)


def test_code_a_library_generates_with_exec_is_its_library_s():
    import collections
    import dataclasses

    ns = {}
    exec("import dataclasses\n@dataclasses.dataclass\nclass P:\n    x: int = 1\ndef mine(z):\n    return z\n", ns)
    P = ns["P"]
    assert not _origin.is_user_function(P.__init__)  # dataclasses' exec, judged by dataclasses
    assert not _origin.is_user_function(P.__eq__)
    assert _origin.is_user_function(ns["mine"])  # the user's own exec string
    N = collections.namedtuple("N", "a b")
    assert not _origin.is_user_function(N.__new__)
    assert dataclasses.is_dataclass(P)


def test_installed_packages_and_the_standard_library_are_library_code():
    assert not _origin.is_user_file(np.__file__)
    assert not _origin.is_user_file(os.__file__)
    assert not _origin.is_user_module("numpy")
    assert not _origin.is_user_module("os")
    assert not _origin.is_user_module("sys")  # a builtin module: no file
    assert not _origin.is_user_function(os.path.join)


def test_nitro_ipy_is_library_code_wherever_it_lives():
    assert not _origin.is_user_file(_origin.__file__)
    assert not _origin.is_user_file(nitro_ipy.__file__)
    assert not _origin.is_user_module("nitro_ipy._training._handle")
    assert not _origin.is_user_function(nitro_ipy.cache_reset)


def test_a_module_in_a_user_directory_is_user_code(tmp_path, monkeypatch):
    mod = import_source(tmp_path, monkeypatch, "nitro_origin_user", USER_SOURCE)
    assert _origin.is_user_file(mod.__file__)
    assert not _origin.is_cell_file(mod.__file__)
    assert _origin.is_user_module("nitro_origin_user")
    assert _origin.is_user_function(mod.helper)
    assert _origin.live_namespace("nitro_origin_user") is vars(mod)
    assert _origin.class_namespace(mod.Model) is vars(mod)
    assert ("nitro_origin_user", vars(mod)) in _origin.user_namespaces()
    assert _origin.user_namespaces()[0][0] == "__main__"


def test_registered_exclusion_is_library_code(tmp_path, monkeypatch, exclusions):
    mod = import_source(tmp_path, monkeypatch, "nitro_origin_excluded", USER_SOURCE)
    assert _origin.is_user_module("nitro_origin_excluded")  # a verdict the exclusion must replace
    _origin.register_exclusion(str(tmp_path) + os.sep)
    assert not _origin.is_user_file(mod.__file__)
    assert not _origin.is_user_module("nitro_origin_excluded")
    assert not _origin.is_user_function(mod.helper)


def test_main_namespace_recorded_stays_authoritative():
    """A shell's user namespace need not be `sys.modules["__main__"]`: the one the code ran in wins."""
    shell_ns = {"__name__": "__main__"}
    assert _origin.live_namespace("__main__", shell_ns) is shell_ns
    assert _origin.live_namespace("__main__") is vars(sys.modules["__main__"])
    gone = {"__name__": "nitro_origin_never_imported"}
    assert _origin.live_namespace("nitro_origin_never_imported", gone) is gone
    assert _origin.live_namespace("nitro_origin_never_imported") is None


def test_class_namespace_is_where_its_methods_run():
    ns = {"__name__": "__main__"}
    exec("class Cell:\n    def f(self):\n        return 1\n", ns)
    assert _origin.class_namespace(ns["Cell"]) is ns
    assert _origin.class_namespace(type("Bare", (), {"__module__": "os"})) is vars(os)
