"""`--model-loader-extra-config` for `--load-format beam`: known keys only, each checked."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LoaderOptions:
    # Reads in flight. Several per disk queue keep NVMe/network storage busy; more adds nothing.
    num_threads: int = 8
    # Largest single read. Large enough for sequential throughput, small enough to spread one
    # big tensor (a 32-expert stack) over all threads.
    chunk_mib: int = 16
    # Read across holes up to this size between the ranges a rank needs (a row-parallel TP
    # slice is one short run per row) instead of one call per run; 0 reads exactly the ranges.
    max_gap_kib: int = 64
    # Host memory for staging (device parameters, dtype conversions) in flight at once.
    max_staging_mib: int = 4096
    # Log progress every this many percent of this rank's bytes.
    progress_percent: int = 10

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "LoaderOptions":
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"--load-format beam: unknown --model-loader-extra-config key(s) {unknown}; "
                             f"known keys: {sorted(known)}")
        for key, value in extra.items():
            least = 0 if key == "max_gap_kib" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"--load-format beam: --model-loader-extra-config {key!r} must be an integer "
                                 f">= {least}, got {value!r}")
        return cls(**extra)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_mib << 20

    @property
    def max_gap_bytes(self) -> int:
        return self.max_gap_kib << 10

    @property
    def max_staging_bytes(self) -> int:
        return self.max_staging_mib << 20
