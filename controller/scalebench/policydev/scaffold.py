"""`scalebench policy new NAME`: a standalone plugin crate built against this repository's
paging-policy.

The crate gets the repository's Cargo.lock, so `cargo build --offline` resolves to the
dependency versions this repository already built (no registry access needed).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..config import REPO_ROOT, ConfigError

TEMPLATE_DIR = Path(__file__).resolve().parent / "template"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


def type_name(name: str) -> str:
    """The Rust type of policy `name`: my_policy -> MyPolicy."""
    return "".join(part.capitalize() for part in name.split("_") if part) or "Policy"


def new_policy(name: str, parent: Path, repo_root: Path = REPO_ROOT) -> Path:
    """Creates parent/name (a crate) and returns its path; ConfigError if the name is not a
    lowercase Rust identifier or the directory exists."""
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"policy name {name!r}: use lowercase letters, digits and '_', starting with a letter"
        )
    paging_policy = (repo_root / "paging-policy").resolve()
    if not (paging_policy / "Cargo.toml").is_file():
        raise ConfigError(f"{paging_policy} is not a paging-policy checkout")
    crate = Path(parent) / name
    if crate.exists():
        raise ConfigError(f"{crate} already exists")
    values = {"name": name, "type_name": type_name(name), "paging_policy": str(paging_policy)}
    (crate / "src").mkdir(parents=True)
    for template, target in (
        ("Cargo.toml.in", "Cargo.toml"),
        ("lib.rs.in", "src/lib.rs"),
        ("README.md.in", "README.md"),
    ):
        text = (TEMPLATE_DIR / template).read_text()
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", value)
        (crate / target).write_text(text)
    (crate / ".gitignore").write_text("/target\n")
    lock = repo_root / "Cargo.lock"
    if lock.is_file():
        shutil.copyfile(lock, crate / "Cargo.lock")
    return crate
