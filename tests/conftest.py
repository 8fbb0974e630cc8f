"""Settings for the whole suite."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_files_below_pytest_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temporary files of the tests and of every process they start go below pytest's own folder.

    torchrun's rendezvous folders, torch's error files and the temporary folders of the libraries
    the ranks use would otherwise be left in /tmp; pytest keeps its last three runs' folders and
    removes older ones.
    """
    folder = str(tmp_path_factory.mktemp("tmp"))
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    yield
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]
