"""The script's repository, read from .git without a git process: the commit of a branch (loose or packed), of
a detached HEAD, of a worktree; dirty when a tracked file changed, was deleted or is unmerged. The index here is
written as git writes it (version 2), so that the fast tier starts no git."""

import hashlib
import os
import shutil
import struct
import subprocess
import time

import pytest

from fitforge.reporting.source import repository_of

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_index(git, root, names, version=2, stage=0, skipped=(), assumed=(), extensions=b""):
    """git's index of the files ``names`` under ``root`` as they are now (their stat and blob ids); those
    ``skipped`` outside a sparse checkout (version 3), those ``assumed`` unchanged; ``extensions`` after them."""
    entries = b""
    for name in sorted(names):
        path = root / name
        info = path.stat()
        content = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(content) + content).digest()
        mode = 0o100755 if info.st_mode & 0o100 else 0o100644
        fields = (int(info.st_ctime), 0, int(info.st_mtime), info.st_mtime_ns % 10**9, 0, 0, mode, 0, 0, info.st_size)
        flags = len(name) | stage << 12 | (0x8000 if name in assumed else 0) | (0x4000 if name in skipped else 0)
        entry = struct.pack(">10L20sH", *fields, blob, flags) + (b"\x40\x00" if name in skipped else b"")
        entry += name.encode()
        entries += entry + b"\0" * (8 - len(entry) % 8)
    index = git / "index"
    index.write_bytes(struct.pack(">4sLL", b"DIRC", version, len(names)) + entries + extensions + b"\0" * 20)
    later = index.stat().st_mtime + 5  # written seconds after the files: their stat is trusted
    os.utime(index, (later, later))


def repository(tmp_path, head="ref: refs/heads/main"):
    root = tmp_path / "repo"
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text(head + "\n")
    (root / ".git" / "refs" / "heads" / "main").write_text(COMMIT + "\n")
    (root / "src").mkdir()
    (root / "src" / "train.py").write_text("print('train')\n")
    (root / "README").write_text("a run\n")
    write_index(root / ".git", root, ["README", "src/train.py"])
    return root


def test_a_clean_checkout_of_a_branch(tmp_path):
    root = repository(tmp_path)
    found = repository_of(root / "src" / "train.py")
    assert found == {"root": str(root), "commit": COMMIT, "branch": "main", "dirty": False}


def test_a_changed_a_deleted_or_an_unmerged_file_makes_it_dirty(tmp_path):
    root = repository(tmp_path)
    (root / "src" / "train.py").write_text("print('TRAIN')\n")  # the same size: its contents tell
    assert repository_of(root)["dirty"] is True
    (root / "src" / "train.py").write_text("print('train')\n")
    assert repository_of(root)["dirty"] is False  # written back: the same blob
    (root / "README").unlink()
    assert repository_of(root)["dirty"] is True
    (root / "README").write_text("a run\n")
    write_index(root / ".git", root, ["README"], stage=2)
    assert repository_of(root)["dirty"] is True
    write_index(root / ".git", root, ["README"], version=4)
    assert repository_of(root)["dirty"] is None  # an index this reader does not know: not told


def test_files_outside_a_sparse_checkout_or_assumed_unchanged_do_not_count(tmp_path):
    root = repository(tmp_path)
    write_index(
        root / ".git", root, ["README", "src/train.py"], version=3, skipped=["README"], assumed=["src/train.py"]
    )
    (root / "README").unlink()  # outside the sparse checkout: absent on purpose
    (root / "src" / "train.py").write_text("print('TRAIN')\n")  # git update-index --assume-unchanged: not looked at
    assert repository_of(root)["dirty"] is False
    (root / "src" / "train.py").write_text("print('train')\n")
    write_index(root / ".git", root, ["src/train.py"], version=3)
    assert repository_of(root)["dirty"] is False  # a version 3 index without extended entries
    (root / "src" / "train.py").write_text("print('TRAIN')\n")
    assert repository_of(root)["dirty"] is True


@pytest.mark.integration  # runs git
def test_a_sparse_checkout_made_by_git_is_clean_until_a_file_in_it_changes(tmp_path):
    def git(*arguments):
        subprocess.run(["git", "-C", str(tmp_path), *arguments], check=True, capture_output=True)

    if shutil.which("git") is None:
        pytest.skip("no git on PATH")
    for folder in ("src", "data"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.txt").write_text(folder + "\n")
    git("init", "-q", "-b", "main")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "two folders")
    git("sparse-checkout", "set", "src")
    assert not (tmp_path / "data").exists()
    assert repository_of(tmp_path / "src" / "a.txt")["dirty"] is False
    time.sleep(1.1)  # a second after git's index: the change is seen by its stat, not only its contents
    (tmp_path / "src" / "a.txt").write_text("changed\n")
    assert repository_of(tmp_path)["dirty"] is True
    git("update-index", "--split-index")
    assert repository_of(tmp_path)["dirty"] is None  # its entries partly in a shared index: not told


def test_a_split_index_is_not_told_other_extensions_are_passed_over(tmp_path):
    root = repository(tmp_path)
    tree = b"TREE" + struct.pack(">L", 6) + b"\0-1 0\n"  # the cache-tree extension: nothing to do with files
    write_index(root / ".git", root, ["README"], extensions=tree)
    assert repository_of(root)["dirty"] is False
    link = b"link" + struct.pack(">L", 20) + b"\1" * 20  # the shared index's id: most entries are there
    write_index(root / ".git", root, ["README"], extensions=tree + link)
    assert repository_of(root)["dirty"] is None


def test_untracked_files_do_not_count(tmp_path):
    root = repository(tmp_path)
    (root / "notes.txt").write_text("scratch\n")
    assert repository_of(root)["dirty"] is False


def test_a_packed_branch_a_detached_head_and_a_worktree(tmp_path):
    root = repository(tmp_path)
    (root / ".git" / "refs" / "heads" / "main").unlink()
    (root / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{COMMIT} refs/heads/main\n")
    assert repository_of(root)["commit"] == COMMIT
    (root / ".git" / "HEAD").write_text("fedcba9876543210fedcba9876543210fedcba98\n")
    assert repository_of(root)["commit"].startswith("fedcba") and repository_of(root)["branch"] is None
    tree = tmp_path / "tree"
    (root / ".git" / "worktrees" / "tree").mkdir(parents=True)
    own = root / ".git" / "worktrees" / "tree"
    (own / "HEAD").write_text("ref: refs/heads/main\n")
    (own / "commondir").write_text("../..\n")
    tree.mkdir()
    (tree / ".git").write_text(f"gitdir: {own}\n")
    found = repository_of(tree)
    assert found["root"] == str(tree) and found["commit"] == COMMIT and found["branch"] == "main"
    assert found["dirty"] is None  # no index yet


def test_outside_a_repository_there_is_none(tmp_path):
    assert repository_of(tmp_path / "no" / "such" / "script.py") is None
