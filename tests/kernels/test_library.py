"""``llm_api.kernels.cpu.library``: a cached library is loaded only when it is this user's and no one else may
write it (the process would run whatever code the file holds), and one that is ours but does not load is built
again, once."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading

import pytest

from llm_api.kernels.cpu import library
from tests.kernels.conftest import build_cache

pytestmark = pytest.mark.skipif(library._compiler() is None, reason="no C compiler: the CPU kernels are not built")


@pytest.fixture
def fresh(monkeypatch):
    """This process as if it had loaded no library yet (restored after the test)."""
    monkeypatch.setattr(library, "_library", None)
    monkeypatch.setattr(library, "_tried", {})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The native build (tests/kernels/conftest.py's cache); each test works on a copy of its cache folder."""
    path = library.build(build_cache())
    cache = tmp_path_factory.mktemp("built")  # (only this build copied: other workers may be building beside it)
    (cache / "cpu-kernels" / path.parent.name).mkdir(parents=True)
    shutil.copy2(path, cache / "cpu-kernels" / path.parent.name / path.name)
    return cache


@pytest.fixture
def tmp_path(tmp_path, built):  # (a cache holding the library already: build() finds it there)
    shutil.copytree(built, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_a_library_others_may_write_is_refused(tmp_path, fresh, caplog):
    built = library.build(tmp_path)
    os.chmod(built, 0o777)
    with pytest.raises(RuntimeError, match="writable by other users"):
        library.build(tmp_path)
    assert library.load(tmp_path) is False and "writable by other users" in caplog.text


def test_a_folder_others_may_write_is_made_private_before_anything_is_checked(tmp_path, fresh):
    built = library.build(tmp_path)
    os.chmod(built.parent, 0o777)
    assert library.build(tmp_path) == built
    assert built.parent.stat().st_mode & 0o022 == 0


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_library_is_refused(tmp_path, fresh):
    built = library.build(tmp_path)
    os.chown(built, 12345, 12345)
    with pytest.raises(RuntimeError, match="belongs to user 12345"):
        library.build(tmp_path)


def test_a_library_that_does_not_load_is_built_again_once(tmp_path, fresh, caplog):
    built = library.build(tmp_path)
    built.write_bytes(b"\x7fELF truncated")
    assert library.load(tmp_path) is True and library.loaded()
    assert "did not load" in caplog.text and built.stat().st_size > 10_000


def test_a_build_under_way_in_another_process_is_waited_for_not_repeated(tmp_path):
    """A second builder of the same library waits on the folder's lock and takes what the first one built: here
    the "first builder" is this test holding the lock and writing the library while ``build`` waits."""
    folder = library.build(tmp_path).parent
    path = folder / library.LIBRARY_NAME
    path.unlink()
    lock = os.open(folder / ".lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(library.build(tmp_path)))
    try:
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not result, "build() went on while another process held the build's lock"
        path.write_bytes(b"the other builder's library")  # (it is found, not compiled again)
    finally:
        os.close(lock)
    waiter.join(30)
    assert result == [path] and path.read_bytes() == b"the other builder's library"
