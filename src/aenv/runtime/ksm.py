"""Kernel same-page merging (KSM) across the node's guests: switching it on, tuning it, and what it
shares.

KSM merges only anonymous pages of areas marked `MADV_MERGEABLE`. QEMU marks every guest RAM
block so (`-machine mem-merge=on` is its default, and a `memory-backend-file` inherits it), so a
host running KSM merges, without any change to the VMMs:
- the copied-on-write pages of a restored guest (its RAM is a private mapping of the template's
  memory file: the pages a guest wrote are anonymous; those it only read stay in the page cache,
  shared already, and KSM skips them);
- the RAM of booted VMs is a shared file mapping, which KSM never merges.

The setting is host-wide (`/sys/kernel/mm/ksm`): `Ksm.enable` remembers what it found and
`Ksm.restore` puts it back, so a node that stops leaves the host as it was.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys/kernel/mm/ksm")
PAGE = 4096
_TUNED = ("run", "pages_to_scan", "sleep_millisecs", "use_zero_pages")


class KsmError(RuntimeError):
    """KSM is not available or cannot be configured."""


@dataclass(frozen=True)
class KsmSettings:
    """How hard ksmd works: `pages_to_scan` pages every `sleep_ms` ms. The defaults scan
    50,000 pages (195 MiB) a second: a node of 400 idle 512 MiB guests, of which ≈ 15 GiB
    are copied-on-write pages, is covered in ≈ 80 s for about 0.1 core."""

    pages_to_scan: int = 1000
    sleep_ms: int = 20
    # Pages that hold only zeros are merged into the kernel's zero page (not counted in
    # pages_sharing but in zero_pages): guests zero pages they free (`init_on_free`, balloons).
    use_zero_pages: bool = True


@dataclass(frozen=True)
class KsmStats:
    running: bool
    pages_shared: int  # distinct merged pages kept
    pages_sharing: int  # pages mapped onto them: what merging saves
    zero_pages: int  # pages merged into the zero page
    full_scans: int

    @property
    def saved_bytes(self) -> int:
        return (self.pages_sharing + self.zero_pages) * PAGE


class Ksm:
    """The host's KSM, through sysfs (needs root to change; reading works for anyone)."""

    def __init__(self, root: Path = SYSFS) -> None:
        self.root = root
        self._previous: dict[str, str] | None = None

    def available(self) -> bool:
        return (self.root / "run").is_file()

    def enable(self, settings: KsmSettings) -> None:
        """Start ksmd with `settings`, remembering the host's values for `restore`. Blocking."""
        if not self.available():
            raise KsmError(f"this kernel has no KSM ({self.root} is missing)")
        if self._previous is None:
            self._previous = {name: self._read(name) for name in _TUNED}
        self._write("pages_to_scan", str(settings.pages_to_scan))
        self._write("sleep_millisecs", str(settings.sleep_ms))
        self._write("use_zero_pages", "1" if settings.use_zero_pages else "0")
        self._write("run", "1")

    def restore(self) -> None:
        """The host's settings from before `enable` (merged pages stay merged until written).
        Blocking."""
        if self._previous is None:
            return
        # `run` last: the tuning it ran with is in place when it restarts.
        for name in sorted(self._previous, key=lambda n: n == "run"):
            with contextlib.suppress(OSError):
                self._write(name, self._previous[name])
        self._previous = None

    def stats(self) -> KsmStats:
        """Host-wide figures. Blocking."""
        if not self.available():
            return KsmStats(False, 0, 0, 0, 0)
        zero = self.root / "ksm_zero_pages"
        return KsmStats(
            running=self._read("run") == "1",
            pages_shared=int(self._read("pages_shared")),
            pages_sharing=int(self._read("pages_sharing")),
            zero_pages=int(zero.read_text()) if zero.is_file() else 0,
            full_scans=int(self._read("full_scans")),
        )

    def _read(self, name: str) -> str:
        return (self.root / name).read_text().strip()

    def _write(self, name: str, value: str) -> None:
        try:
            (self.root / name).write_text(value)
        except OSError as exc:
            raise KsmError(f"cannot set KSM {name}={value}: {exc}") from exc


def merged_pages(pid: int) -> int:
    """Pages of process `pid` that KSM merged (into shared pages or the zero page); 0 when the
    process is gone or the kernel does not say. Blocking."""
    try:
        text = Path(f"/proc/{pid}/ksm_stat").read_text()
    except OSError:
        return 0
    fields = dict(line.split(maxsplit=1) for line in text.splitlines() if " " in line)
    return int(fields.get("ksm_merging_pages", "0")) + int(fields.get("ksm_zero_pages", "0"))
