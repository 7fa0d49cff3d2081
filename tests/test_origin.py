"""Whose code is this (`nitro_ipy._origin`): notebook cells of both front ends, the standard library,
installed packages, nitro_ipy itself, the user's own module files, and registered exclusions."""

import os
import sys

import numpy as np
import pytest

import nitro_ipy
from nitro_ipy import _origin
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


@pytest.mark.parametrize("name", ["<string>", "<stdin>", "<timed exec>", "<frozen importlib._bootstrap>", "", None])
def test_other_pseudo_files_are_library_code(name):
    assert not _origin.is_user_file(name)


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
    assert not _origin.is_user_module("nitro_ipy._handle")
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
