"""Everything is in pyproject.toml; this file only makes editable installs ship the data files too."""

from setuptools import setup
from setuptools.dist import Distribution


class _Distribution(Distribution):
    # setuptools' editable_wheel installs data files only when `has_data()` says so, a method distutils
    # names `has_data_files()`: so `pip install -e .` silently skipped them (a normal install ships them).
    # The one data file is the server extension's config (pyproject.toml, [tool.setuptools.data-files]).
    def has_data(self):
        return self.has_data_files()


setup(distclass=_Distribution)
