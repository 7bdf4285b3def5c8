"""nemo_rz.atomic: a write interrupted at any point leaves the old file or directory, and no temporary names."""
import json
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


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_files_and_directories_get_a_normal_mode_under_any_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert atomic.umask() == mask and atomic.umask() == mask  # reading it leaves it as it was
        atomic.write_text(tmp_path / "a.txt", "x")
        atomic.write_bytes(tmp_path / "b.bin", b"x")
        atomic.write_json(tmp_path / "c.json", {"x": 1})
        with atomic.new_dir(tmp_path / "d") as tmp:
            fd = atomic.create(tmp / "e")
            os.close(fd)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*")}
    assert modes == {"a.txt": oct(0o666 & ~mask), "b.bin": oct(0o666 & ~mask), "c.json": oct(0o666 & ~mask),
                     "d": oct(0o777 & ~mask), "e": oct(0o666 & ~mask)}


def test_create_never_opens_an_existing_file_or_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("keep")
    (tmp_path / "link").symlink_to(outside)
    for name in ("outside", "link"):
        with pytest.raises(FileExistsError):
            atomic.create(tmp_path / name)
    assert outside.read_text() == "keep"


def test_write_json_is_standard_json_with_null_for_non_finite_numbers(tmp_path):
    path = tmp_path / "summary.json"
    value = {"ratio": float("inf"), "low": float("-inf"), "nan": float("nan"), "ok": 1.5, "n": 3,
             "nested": [{"x": float("inf")}, (2.0, float("nan"))], "name": "run"}
    atomic.write_json(path, value)

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "ratio": None, "low": None, "nan": None, "ok": 1.5, "n": 3, "nested": [{"x": None}, [2.0, None]], "name": "run"}
    assert value["ratio"] == float("inf")  # the caller's value is not changed
    with pytest.raises(ValueError, match="non-standard"):  # negative control: what json.dumps writes by default
        json.loads(json.dumps(value), parse_constant=refuse)


def test_new_dir_replaces_a_symlink_without_touching_what_it_points_to(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "step_000002").symlink_to(outside)
    (ckpts / "step_000003").symlink_to(tmp_path / "nowhere")  # dangling
    for name in ("step_000002", "step_000003"):
        with atomic.new_dir(ckpts / name) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
        assert not (ckpts / name).is_symlink() and (ckpts / name / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003"]
    assert (outside / "keep").read_text() == "keep" and [p.name for p in outside.iterdir()] == ["keep"]


@pytest.mark.parametrize("name, target, expected", [
    (".step_000004.tmp-ab12cd34", None, True), (".step_000004.old-ab12cd34", "step_000004", True),
    (".metrics.jsonl.tmp-0f0f", "metrics.jsonl", True), (".step_000004.tmp-ab12", "step_000005", False),
    ("step_000004", None, False), (".step_000004.tmp-", None, False), (".hidden", None, False), (".a.new-x", None, False),
])
def test_is_leftover_knows_the_temporary_names(name, target, expected):
    assert atomic.is_leftover(name, target) is expected
