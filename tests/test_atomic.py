"""nemo_rz.atomic: a write interrupted at any point leaves the old file or directory, and no temporary names."""
import os

import pytest

from nemo_rz import atomic


def test_write_text_replaces_or_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic.write_text(path, "old")
    assert path.read_text() == "old" and os.stat(path).st_mode & 0o777 == 0o666 & ~atomic.umask()

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    monkeypatch.undo()
    atomic.write_text(path, "new")  # negative control: the same call without the fault does replace it
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_new_dir_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "step_000003"
    with pytest.raises(RuntimeError, match="crash"):
        with atomic.new_dir(target) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    with atomic.new_dir(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"whole")
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"] and (target / "model.safetensors").read_bytes() == b"whole"
    with atomic.new_dir(target) as tmp:  # an existing directory is replaced as a whole
        (tmp / "other").write_bytes(b"x")
    assert [p.name for p in target.iterdir()] == ["other"] and len(list(tmp_path.iterdir())) == 1
