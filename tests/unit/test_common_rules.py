"""common/: the rules quant/ and engram/ share (atomic writes, /proc facts, source digests, sizes)."""

from __future__ import annotations

import os
import stat

import pytest

from fp8_engram.common import files, fingerprint, proc, sizes

pytestmark = pytest.mark.unit


def test_an_atomic_write_replaces_the_file_whole_with_the_mode_of_a_new_file(tmp_path):
    path = tmp_path / "verdicts.json"
    path.write_text("old")
    old_umask = os.umask(0o022)
    try:
        files.write_atomic(path, "new text")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new text"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # 0666 less the umask, not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["verdicts.json"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "table.safetensors"
    path.write_bytes(b"before")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        files.write_atomic(path, b"after")
    assert path.read_bytes() == b"before"
    assert [p.name for p in tmp_path.iterdir()] == ["table.safetensors"]


def test_temporary_files_never_collide(tmp_path):
    made = [files.new_temp_file(str(tmp_path), ".x.", ".tmp") for _ in range(20)]
    for fd, _ in made:
        os.close(fd)
    assert len({p for _, p in made}) == 20


def test_source_digest_changes_with_a_file_and_keeps_its_length(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    full, short = fingerprint.source_digest(tmp_path), fingerprint.source_digest(tmp_path, "sha1", 12)
    assert len(full) == 64 and len(short) == 12
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert fingerprint.source_digest(tmp_path) != full
    assert fingerprint.source_digest(tmp_path, "sha1", 12) != short


def test_proc_readers_read_this_process_and_say_none_for_a_missing_one(tmp_path):
    assert proc.process_state(os.getpid()) in ("R", "S", "D")
    status = proc.kib_fields("/proc/self/status")
    assert status is None or status.get("VmSize", 0) > 0
    assert proc.kib_fields(str(tmp_path / "missing")) is None
    assert proc.process_state(2**22 + 12345) is None  # above any pid_max
    assert proc.overcommit_mode() in (None, 0, 1, 2)


def test_size_text():
    assert sizes.size_text(3 << 29) == "1.50 GiB"
    assert sizes.size_text(12 << 20) == "12 MiB"
    assert sizes.size_text(3 << 19, mib_digits=1) == "1.5 MiB"
