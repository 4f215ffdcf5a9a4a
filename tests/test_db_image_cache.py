"""The database image's build cache (guest-images/dbguest/buildcache.py and the keys in build.py),
without building an image: the build functions here write a few small files."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DBGUEST = Path(__file__).resolve().parent.parent / "guest-images" / "dbguest"
sys.path.insert(0, str(DBGUEST))

import buildcache  # noqa: E402
from buildcache import MANIFEST, BuildCache, verify  # noqa: E402


def _load_build(src: Path):  # type: ignore[no-untyped-def]
    """build.py under a module name of its own (not pypa's `build`)."""
    spec = importlib.util.spec_from_file_location("dbguest_build", src / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """A copy of the image's recipe files, free to edit."""
    src = tmp_path / "dbguest"
    src.mkdir()
    for name in ("build.py", "sbinit.sh"):
        shutil.copy(DBGUEST / name, src / name)
    shutil.copytree(DBGUEST / "sql", src / "sql")
    return src


def _image(out: Path, payload: bytes = b"kernel") -> None:
    (out / "vmlinuz").write_bytes(payload)
    (out / "big.img").write_bytes(b"\0" * 4096)
    (out / "sub").mkdir()
    (out / "sub" / "probe.json").write_text('{"n": 1}\n')
    (out / "link").symlink_to("vmlinuz")


def test_image_key_changes_with_each_input_and_only_then(recipe: Path) -> None:
    build = _load_build(DBGUEST)
    base = build.base_key()
    key = build.image_key(base, recipe)
    assert len(key) == 64 and key == build.image_key(base, recipe)
    assert key == build.image_key(base, DBGUEST)  # a copy keys as its original
    assert build.image_key("another base", recipe) != key
    seen = {key}
    for edit in ("build.py", "sbinit.sh", "sql/tpcc.sql", "sql/probe.sql"):
        path = recipe / edit
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        changed = build.image_key(base, recipe)
        assert changed not in seen, edit
        seen.add(changed)
        path.write_bytes(original)
        assert build.image_key(base, recipe) == key
    (recipe / "sql" / "extra.sql").write_text("SELECT 1;\n")
    assert build.image_key(base, recipe) not in seen
    (recipe / "sql" / "extra.sql").unlink()
    # A file renamed with its content kept is a different recipe.
    (recipe / "sql" / "tpcc.sql").rename(recipe / "sql" / "tpcc2.sql")
    assert build.image_key(base, recipe) not in seen


@pytest.mark.parametrize(
    "name, value",
    [
        ("SUITE", "trixie"),
        ("BASE_PACKAGES", ("postgresql-16",)),
        ("KERNEL_PACKAGE", "linux-image-amd64"),
        ("INITRD_MODULES", ("virtio_pci",)),
    ],
)
def test_base_key_changes_with_the_distribution_and_packages(
    name: str, value: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = _load_build(DBGUEST)
    base = build.base_key()
    image = build.image_key(base)
    monkeypatch.setattr(build, name, value)
    assert build.base_key() != base
    assert build.image_key(build.base_key()) != image


def test_default_cache_is_outside_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    build = _load_build(DBGUEST)
    monkeypatch.delenv("SCALEBENCH_CACHE_DIR", raising=False)
    assert build.default_cache_dir() == Path("/var/cache/scalebench/dbguest")
    monkeypatch.setenv("SCALEBENCH_CACHE_DIR", "/srv/c")
    assert build.default_cache_dir() == Path("/srv/c/dbguest")


def test_a_miss_builds_once_and_a_hit_reuses(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache")
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        assert out.name.startswith("image-k.partial-")  # built aside, not in place
        _image(out)

    entry = cache.ensure("image-k", build)
    assert entry == tmp_path / "cache" / "image-k" and (entry / "vmlinuz").read_bytes() == b"kernel"
    assert verify(entry) is None and (entry / MANIFEST).exists()
    assert cache.ensure("image-k", build) == entry and len(calls) == 1
    assert BuildCache(tmp_path / "cache").lookup("image-k") == entry
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".lock", "image-k"]


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path)

    def fails(out: Path) -> None:
        _image(out)
        raise RuntimeError("debootstrap failed")

    with pytest.raises(RuntimeError, match="debootstrap failed"):
        cache.ensure("image-k", fails)
    assert cache.lookup("image-k") is None
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_a_partial_build_left_by_a_killed_builder_is_never_used(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path)
    stale = tmp_path / "image-k.partial-4242"  # a builder killed mid-way (no rename, no manifest)
    stale.mkdir()
    _image(stale, b"half")
    assert cache.lookup("image-k") is None
    entry = cache.ensure("image-k", _image)
    assert (entry / "vmlinuz").read_bytes() == b"kernel"
    assert not stale.exists()


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda e: (e / MANIFEST).unlink(), "no readable MANIFEST.json"),
        (lambda e: (e / MANIFEST).write_text('{"files": '), "no readable MANIFEST.json"),
        (lambda e: (e / "vmlinuz").unlink(), "vmlinuz: missing"),
        (lambda e: (e / "big.img").write_bytes(b"\0" * 100), "big.img: 100 bytes, 4096 recorded"),
        (lambda e: (e / "vmlinuz").write_bytes(b"kernex"), "vmlinuz: content changed"),
        (lambda e: (e / "sub" / "probe.json").write_text('{"n": 2}\n'), "content changed"),
        (lambda e: (e / "link").unlink(), "link: symlink changed"),
    ],
)
def test_a_damaged_entry_is_not_used_and_is_built_again(tmp_path: Path, damage, why: str) -> None:  # type: ignore[no-untyped-def]
    cache = BuildCache(tmp_path)
    entry = cache.ensure("image-k", _image)
    damage(entry)
    assert why in (verify(entry) or "")
    assert cache.lookup("image-k") is None
    calls = []
    rebuilt = cache.ensure("image-k", lambda out: (calls.append(out), _image(out)))
    assert rebuilt == entry and calls and verify(rebuilt) is None


def test_large_files_are_hashed_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buildcache, "HASH_CHECK_MAX_BYTES", 1024)
    entry = BuildCache(tmp_path).ensure("image-k", _image)
    with (entry / "big.img").open("r+b") as f:  # same size, other bytes
        f.write(b"x")
    assert verify(entry) is None  # at lookup: its size only
    assert verify(entry, full=True) == "big.img: content changed"


def test_nested_levels_share_one_lock(tmp_path: Path) -> None:
    """The image's build ensures its base under the lock it already holds (no self-deadlock)."""
    cache = BuildCache(tmp_path)

    def image(out: Path) -> None:
        base = cache.ensure("base-b", lambda d: (d / "root").mkdir())
        (out / "from").write_text(base.name)

    entry = cache.ensure("image-i", image)
    assert (entry / "from").read_text() == "base-b" and cache.lookup("base-b") is not None


# A builder in a process of its own, as two CI jobs on one host are: it counts its build, then
# takes long enough that the other starts while it holds the lock.
SLOW_BUILDER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from buildcache import BuildCache
def build(out):
    with open(sys.argv[3], "a") as f:
        f.write("built\\n")
    time.sleep(0.5)
    (out / "vmlinuz").write_bytes(b"kernel")
print(BuildCache(Path(sys.argv[2])).ensure("image-k", build))
"""


def test_a_concurrent_second_builder_waits_and_reuses(tmp_path: Path) -> None:
    counter = tmp_path / "builds"
    argv = [sys.executable, "-c", SLOW_BUILDER, str(DBGUEST), str(tmp_path / "c"), str(counter)]
    builders = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = [b.communicate(timeout=60)[0].strip() for b in builders]
    assert [b.returncode for b in builders] == [0, 0]
    assert paths[0] == paths[1] != "" and counter.read_text() == "built\n"
