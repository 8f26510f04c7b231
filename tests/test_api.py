"""autosoft/api.py without a GPU: what the public functions say to a Python caller."""
from __future__ import annotations

import pytest

import autosoft


def test_load_cache_of_a_folder_speaks_to_a_python_caller(tmp_path):
    """Not the command line's "pass --cache": a Python caller passed no flag."""
    with pytest.raises(autosoft.UserError) as refused:
        autosoft.load_cache(str(tmp_path))
    assert str(refused.value) == (f"autosoft.load_cache: {str(tmp_path)!r} is a folder; give the path of a cache file "
                                  "(the kernels.sqlite that `autosoft tune` writes)")
    with pytest.raises(autosoft.UserError, match="is a folder"):
        autosoft.load_cache(tmp_path)  # a Path too
    with pytest.raises(autosoft.UserError, match="no such file"):
        autosoft.load_cache(str(tmp_path / "missing.sqlite"))
