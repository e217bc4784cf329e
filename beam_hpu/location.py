"""Where a model's files are on this host: the one answer the guards, the FP8 checkpoint check and
`--load-format beam` share. Never a network call; imports neither torch nor vLLM."""

from __future__ import annotations

from pathlib import Path


def local_checkpoint_dir(model: str | None, revision: str | None = None) -> Path | None:
    """`model` itself when it is a directory, else its snapshot in the local Hugging Face cache
    (when vLLM, or anyone, already downloaded it); None when it is neither."""
    if not model:
        return None
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, not cached, or no huggingface_hub: not on this host
        return None
